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
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
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

  const std::string& endpoint() const { return endpoint_; }

  // A client of `bucket` on this server (created if need be), with short
  // timeouts and retry delays for tests.
  absl::StatusOr<S3Client> Client(const std::string& bucket) const {
    S3Config config;
    config.endpoint = endpoint_;
    config.bucket = bucket;
    config.credentials = {"testing", "testing", ""};
    config.retry_base_delay_ms = 1;
    auto client = S3Client::Create(config);
    if (!client.ok()) return client.status();
    if (absl::Status s = client->CreateBucket(); !s.ok()) return s;
    return client;
  }

  ~MotoServer() {
    ::kill(pid_, SIGTERM);
    int status;
    ::waitpid(pid_, &status, 0);
  }

 private:
  MotoServer(pid_t pid, std::string endpoint)
      : pid_(pid), endpoint_(std::move(endpoint)) {}

  static absl::StatusOr<std::unique_ptr<MotoServer>> Start() {
    const char* python_env = std::getenv("CAIRN_PYTHON");
    const std::string python = python_env ? python_env : "python3";
    const std::string probe = absl::StrCat(
        python, " -c 'import moto.server' > /dev/null 2>&1");
    if (std::system(probe.c_str()) != 0) {
      return absl::UnavailableError(absl::StrFormat(
          "moto is not installed for %s (pip install -r "
          "python/requirements.txt)",
          python));
    }
    const int port = FreeLocalPort();
    const std::string log =
        absl::StrFormat("/tmp/cairn-moto-%d-%d.log", ::getpid(), port);
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
      const std::string port_text = std::to_string(port);
      ::execlp(python.c_str(), python.c_str(), "-m", "moto.server", "-H",
               "127.0.0.1", "-p", port_text.c_str(), (char*)nullptr);
      _exit(127);
    }
    if (pid < 0) return absl::InternalError("fork failed");
    const std::string endpoint = absl::StrCat("http://127.0.0.1:", port);
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    while (absl::Now() < deadline) {
      HttpRequest ping;
      ping.method = "GET";
      ping.url = endpoint + "/moto-api/";
      ping.connect_timeout_ms = 500;
      ping.stall_timeout_ms = 2000;
      absl::StatusOr<HttpResponse> r = SendHttp(ping);
      if (r.ok() && r->status < 500) {
        return std::unique_ptr<MotoServer>(new MotoServer(pid, endpoint));
      }
      int status;
      if (::waitpid(pid, &status, WNOHANG) == pid) {
        return absl::UnavailableError(absl::StrFormat(
            "moto server exited at start; see %s", log));
      }
      absl::SleepFor(absl::Milliseconds(100));
    }
    ::kill(pid, SIGKILL);
    return absl::DeadlineExceededError(absl::StrFormat(
        "moto server did not answer on %s within 60 s; see %s", endpoint,
        log));
  }

  pid_t pid_;
  std::string endpoint_;
};

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
