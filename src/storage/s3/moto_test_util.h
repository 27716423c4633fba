// A real S3-compatible server for tests: moto's server mode
// (python3 -m moto.server, pip moto[server], installed by the README's
// test command), started on a free port of 127.0.0.1 the first time a test
// asks and stopped when the test binary exits (and by the kernel if the
// binary dies first: PR_SET_PDEATHSIG).
//
// Where moto is not installed the tests skip with that reason, unless
// CAIRN_REQUIRE_S3_SERVER=1 (set by the README's test command and CI):
// then they fail.
#ifndef CAIRN_STORAGE_S3_MOTO_TEST_UTIL_H_
#define CAIRN_STORAGE_S3_MOTO_TEST_UTIL_H_

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cairn/storage.h"
#include "gtest/gtest.h"
#include "storage/s3/http.h"
#include "storage/s3/s3_client.h"

namespace cairn::internal_s3 {

inline int FreeLocalPort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  ::close(fd);
  return port;
}

// A child process serving HTTP on 127.0.0.1:port, killed when this object
// goes (and by the kernel when this process dies: PR_SET_PDEATHSIG).
class ChildServer {
 public:
  // Runs `argv` (argv[0] looked up on PATH) with output to `log`, then
  // waits up to 60 s until GET `ready_path` answers below 500.
  static absl::StatusOr<std::unique_ptr<ChildServer>> Start(
      std::vector<std::string> argv, int port, const std::string& ready_path,
      const std::string& log) {
    const pid_t parent = ::getpid();
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (::getppid() != parent) _exit(1);
      const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd >= 0) {
        ::dup2(fd, 1);
        ::dup2(fd, 2);
      }
      std::vector<char*> args;
      for (std::string& a : argv) args.push_back(a.data());
      args.push_back(nullptr);
      ::execvp(args[0], args.data());
      _exit(127);
    }
    if (pid < 0) return absl::InternalError("fork failed");
    auto child = std::unique_ptr<ChildServer>(
        new ChildServer(pid, absl::StrCat("http://127.0.0.1:", port)));
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    while (absl::Now() < deadline) {
      HttpRequest ping;
      ping.method = "GET";
      ping.url = child->endpoint() + ready_path;
      ping.connect_timeout_ms = 500;
      ping.stall_timeout_ms = 2000;
      absl::StatusOr<HttpResponse> r = SendHttp(ping);
      if (r.ok() && r->status < 500) return child;
      int status;
      if (::waitpid(pid, &status, WNOHANG) == pid) {
        child->pid_ = -1;
        return absl::UnavailableError(absl::StrFormat(
            "%s exited at start; see %s", argv[0], log));
      }
      absl::SleepFor(absl::Milliseconds(100));
    }
    return absl::DeadlineExceededError(absl::StrFormat(
        "%s did not answer on %s within 60 s; see %s", argv[0],
        child->endpoint(), log));
  }

  ~ChildServer() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    int status;
    ::waitpid(pid_, &status, 0);
  }

  const std::string& endpoint() const { return endpoint_; }

 private:
  ChildServer(pid_t pid, std::string endpoint)
      : pid_(pid), endpoint_(std::move(endpoint)) {}
  pid_t pid_;
  std::string endpoint_;
};

inline std::string TestPython() {
  const char* python = std::getenv("CAIRN_PYTHON");
  return python != nullptr && *python ? python : "python3";
}

class MotoServer {
 public:
  // The process-wide server, started on first use; an error says why
  // there is none.
  static absl::StatusOr<const MotoServer*> Shared() {
    // Destroyed at exit, which stops the server.
    static absl::StatusOr<std::unique_ptr<MotoServer>> server = Start();
    if (!server.ok()) return server.status();
    return server->get();
  }

  const std::string& endpoint() const { return child_->endpoint(); }

  // Options that reach this server, with test credentials, the smallest
  // parts (8 MiB) and short retry delays.
  S3Options Options() const {
    S3Options o;
    o.endpoint = endpoint();
    o.access_key_id = "testing";
    o.secret_access_key = "testing";
    o.part_bytes = 8 << 20;
    o.retry_base_delay_ms = 1;
    return o;
  }

  // A client of `bucket` on this server (created if need be), with short
  // retry delays for tests.
  absl::StatusOr<S3Client> Client(const std::string& bucket) const {
    S3Config config;
    config.endpoint = endpoint();
    config.bucket = bucket;
    config.credentials = {"testing", "testing", ""};
    config.retry_base_delay_ms = 1;
    auto client = S3Client::Create(config);
    if (!client.ok()) return client.status();
    if (absl::Status s = client->CreateBucket(); !s.ok()) return s;
    return client;
  }

 private:
  explicit MotoServer(std::unique_ptr<ChildServer> child)
      : child_(std::move(child)) {}

  static absl::StatusOr<std::unique_ptr<MotoServer>> Start() {
    const std::string python = TestPython();
    const std::string probe =
        absl::StrCat(python, " -c 'import moto.server' > /dev/null 2>&1");
    if (std::system(probe.c_str()) != 0) {
      return absl::UnavailableError(absl::StrFormat(
          "moto is not installed for %s (pip install -r "
          "python/requirements.txt)",
          python));
    }
    const int port = FreeLocalPort();
    absl::StatusOr<std::unique_ptr<ChildServer>> child = ChildServer::Start(
        {python, "-m", "moto.server", "-H", "127.0.0.1", "-p",
         std::to_string(port)},
        port, "/moto-api/",
        absl::StrFormat("/tmp/cairn-moto-%d-%d.log", ::getpid(), port));
    if (!child.ok()) return child.status();
    return std::unique_ptr<MotoServer>(new MotoServer(*std::move(child)));
  }

  std::unique_ptr<ChildServer> child_;
};

#ifdef CAIRN_SOURCE_DIR
// tests/s3_fault_proxy.py in front of `upstream`: Arm() makes the next
// requests fail in one of its ways.
class FaultProxy {
 public:
  static absl::StatusOr<std::unique_ptr<FaultProxy>> Start(
      const std::string& upstream) {
    const int port = FreeLocalPort();
    absl::StatusOr<std::unique_ptr<ChildServer>> child = ChildServer::Start(
        {TestPython(), CAIRN_SOURCE_DIR "/tests/s3_fault_proxy.py",
         "--upstream", upstream, "--port", std::to_string(port)},
        port, "/__stats__",
        absl::StrFormat("/tmp/cairn-fault-proxy-%d-%d.log", ::getpid(), port));
    if (!child.ok()) return child.status();
    return std::unique_ptr<FaultProxy>(new FaultProxy(*std::move(child)));
  }

  const std::string& endpoint() const { return child_->endpoint(); }

  // `json` as s3_fault_proxy.py documents: {"fault": "status", ...}.
  absl::Status Arm(const std::string& json) const {
    HttpRequest r;
    r.method = "POST";
    r.url = endpoint() + "/__fault__";
    r.body = std::as_bytes(std::span(json));
    absl::StatusOr<HttpResponse> response = SendHttp(r);
    if (!response.ok()) return response.status();
    if (response->status != 200) {
      return absl::InternalError(absl::StrCat("arming failed: ", response->body));
    }
    return absl::OkStatus();
  }

  // The number of faults injected so far.
  absl::StatusOr<int> Faults() const {
    HttpRequest r;
    r.method = "GET";
    r.url = endpoint() + "/__stats__";
    absl::StatusOr<HttpResponse> response = SendHttp(r);
    if (!response.ok()) return response.status();
    const size_t at = response->body.find("\"faults\": ");
    if (at == std::string::npos) return absl::InternalError(response->body);
    return std::atoi(response->body.c_str() + at + 10);
  }

 private:
  explicit FaultProxy(std::unique_ptr<ChildServer> child)
      : child_(std::move(child)) {}
  std::unique_ptr<ChildServer> child_;
};
#endif  // CAIRN_SOURCE_DIR

// In a test body or SetUp: the shared server, or skip (fail when
// CAIRN_REQUIRE_S3_SERVER=1).
#define CAIRN_MOTO_OR_SKIP(var)                                             \
  absl::StatusOr<const ::cairn::internal_s3::MotoServer*> var##_or =        \
      ::cairn::internal_s3::MotoServer::Shared();                           \
  if (!var##_or.ok()) {                                                     \
    const char* require = std::getenv("CAIRN_REQUIRE_S3_SERVER");           \
    if (require != nullptr && std::string(require) == "1") {                \
      FAIL() << "no S3 server: " << var##_or.status();                      \
    }                                                                       \
    GTEST_SKIP() << "no S3 server: " << var##_or.status();                  \
  }                                                                         \
  const ::cairn::internal_s3::MotoServer* var = *var##_or

}  // namespace cairn::internal_s3

#endif  // CAIRN_STORAGE_S3_MOTO_TEST_UTIL_H_
