#include "storage/s3/sigv4.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace cairn::internal_s3 {
namespace {

using ::testing::HasSubstr;

SigningRequest Get(std::string path) {
  SigningRequest r;
  r.method = "GET";
  r.host = "bucket.s3.eu-west-1.amazonaws.com";
  r.path = std::move(path);
  r.payload_sha256 = Sha256Hex(std::string_view());
  return r;
}

const Credentials kKeys{"AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY",
                        ""};

TEST(SigV4Test, Sha256OfKnownInputs) {
  EXPECT_EQ(Sha256Hex(std::string_view()),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(Sha256Hex(std::string_view("abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(SigV4Test, UriEncodeKeepsUnreservedOnly) {
  EXPECT_EQ(UriEncode("a-Z_0.~", false), "a-Z_0.~");
  EXPECT_EQ(UriEncode("a b/c+d=é", false), "a%20b%2Fc%2Bd%3D%C3%A9");
  EXPECT_EQ(UriEncode("/bucket/a b/rank-0.safetensors", true),
            "/bucket/a%20b/rank-0.safetensors");
}

TEST(SigV4Test, CanonicalRequestSortsQueryAndHeaders) {
  SigningRequest r = Get("/k ey");
  r.query = {{"uploadId", "x/y"}, {"partNumber", "2"}, {"uploads", ""}};
  const std::string c = CanonicalRequest(
      r, {{"host", "h"}, {"range", "bytes=0-9"}, {"x-amz-date", "d"}});
  EXPECT_EQ(c,
            "GET\n/k%20ey\npartNumber=2&uploadId=x%2Fy&uploads=\n"
            "host:h\nrange:bytes=0-9\nx-amz-date:d\n\n"
            "host;range;x-amz-date\n" +
                r.payload_sha256);
}

TEST(SigV4Test, SignsWithTheHeadersItAdds) {
  SigningRequest r = Get("/ckpt/metadata.json");
  r.headers = {{"Range", "  bytes=0-99  "}, {"If-None-Match", "*"}};
  Credentials keys = kKeys;
  keys.session_token = "token/with+chars";
  absl::StatusOr<Headers> h =
      SignV4(r, keys, "eu-west-1", "s3", "20261127T213357Z");
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_EQ(h->size(), 5u);
  EXPECT_EQ((*h)[0].first, "host");
  EXPECT_EQ((*h)[3], (std::pair<std::string, std::string>(
                         "x-amz-security-token", "token/with+chars")));
  const std::string& auth = (*h)[4].second;
  EXPECT_THAT(auth, HasSubstr("Credential=AKIDEXAMPLE/20261127/eu-west-1/s3/"
                              "aws4_request, SignedHeaders=host;if-none-match;"
                              "range;x-amz-content-sha256;x-amz-date;"
                              "x-amz-security-token, Signature="));
  // The signature changes with every signed input.
  absl::StatusOr<Headers> other =
      SignV4(r, keys, "eu-west-2", "s3", "20261127T213357Z");
  ASSERT_TRUE(other.ok());
  EXPECT_NE((*other)[4].second.substr(auth.size() - 64), auth.substr(auth.size() - 64));
}

TEST(SigV4Test, RefusesBadInput) {
  const SigningRequest r = Get("/x");
  EXPECT_THAT(SignV4(r, kKeys, "r", "s3", "2026-11-27T21:33Z").status().message(),
              HasSubstr("is not YYYYMMDDTHHMMSSZ"));
  EXPECT_EQ(SignV4(r, {}, "r", "s3", "20261127T213357Z").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SignV4(r, kKeys, "", "s3", "20261127T213357Z").status().code(),
            absl::StatusCode::kInvalidArgument);
  SigningRequest bad = r;
  bad.headers = {{"x-meta", "a\nb"}};
  EXPECT_THAT(SignV4(bad, kKeys, "r", "s3", "20261127T213357Z").status().message(),
              HasSubstr("control character"));
  bad.headers = {{"Authorization", "x"}};
  EXPECT_THAT(SignV4(bad, kKeys, "r", "s3", "20261127T213357Z").status().message(),
              HasSubstr("the signer's to set"));
  bad = r;
  bad.payload_sha256.clear();
  EXPECT_THAT(SignV4(bad, kKeys, "r", "s3", "20261127T213357Z").status().message(),
              HasSubstr("no payload hash"));
}

}  // namespace
}  // namespace cairn::internal_s3
