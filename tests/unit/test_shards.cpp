// Token shards: round trips against the documents written (tokens, masks, document starts,
// reads across shard boundaries), both token widths, index.json totals, and rejection of
// corrupt, truncated and mismatched files with Error(kData) naming the file, including a
// seeded random-mutation fuzz test.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "shardlm/core/check.h"
#include "shardlm/io/shards.h"
#include "test_util.h"

namespace shardlm {
namespace {

namespace fs = std::filesystem;

// A fresh directory per test, removed afterwards.
class ShardsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    root_ = shardlm::test::scratch_root() /
            fmt::format("shardlm_test_shards_{}_{}", ::getpid(), info->name());
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override { fs::remove_all(root_); }
  std::string path(const std::string& name) const { return (root_ / name).string(); }
  fs::path root_;
};

struct Doc {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> mask;  // empty = all targets
};

// Reference: the documents concatenated, masks expanded (1s where a document has none).
struct Expected {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> mask;
  std::vector<int64_t> doc_starts;
};

Expected concat(const std::vector<Doc>& docs) {
  Expected e;
  for (const Doc& d : docs) {
    e.doc_starts.push_back(int64_t(e.tokens.size()));
    e.tokens.insert(e.tokens.end(), d.tokens.begin(), d.tokens.end());
    if (d.mask.empty())
      e.mask.insert(e.mask.end(), d.tokens.size(), 1);
    else
      e.mask.insert(e.mask.end(), d.mask.begin(), d.mask.end());
  }
  return e;
}

std::vector<Doc> random_docs(uint64_t seed, int n_docs, int max_len, int32_t vocab,
                             double masked_fraction) {
  std::mt19937_64 rng(seed);
  std::vector<Doc> docs(n_docs);
  for (Doc& d : docs) {
    const int len = 1 + int(rng() % uint64_t(max_len));
    for (int i = 0; i < len; ++i) d.tokens.push_back(int32_t(rng() % uint64_t(vocab)));
    if (std::uniform_real_distribution<double>(0, 1)(rng) < masked_fraction)
      for (int i = 0; i < len; ++i) d.mask.push_back(uint8_t(rng() % 2));
  }
  return docs;
}

CorpusInfo write_corpus(const std::string& dir, const std::vector<Doc>& docs, int64_t vocab,
                        int64_t max_shard_tokens) {
  ShardWriter w(dir, "test", vocab, max_shard_tokens);
  for (const Doc& d : docs)
    w.add_document(d.tokens.data(), int64_t(d.tokens.size()),
                   d.mask.empty() ? nullptr : d.mask.data());
  return w.finish();
}

void expect_reads_match(const TokenCorpus& c, const Expected& e) {
  const int64_t n = int64_t(e.tokens.size());
  ASSERT_EQ(c.info().n_tokens, n);
  EXPECT_EQ(c.doc_starts(), e.doc_starts);
  std::vector<int32_t> out(n);
  std::vector<uint8_t> mask(n);
  // Every start with a few lengths, so that reads begin and end on and across boundaries.
  for (int64_t begin = 0; begin < n; ++begin) {
    for (int64_t len : {int64_t(1), int64_t(7), int64_t(40), n - begin}) {
      len = std::min(len, n - begin);
      c.read(begin, len, out.data(), mask.data());
      for (int64_t i = 0; i < len; ++i) {
        ASSERT_EQ(out[i], e.tokens[begin + i]) << "token " << begin + i;
        ASSERT_EQ(mask[i], e.mask[begin + i]) << "mask " << begin + i;
      }
    }
  }
  c.read(0, n, out.data(), nullptr);
  EXPECT_EQ(out, e.tokens);
}

// Expects Error(kData) whose message names `file`.
template <class F>
void expect_data_error(F&& f, const std::string& file, const std::string& what = "") {
  try {
    f();
    ADD_FAILURE() << "no error; expected kData naming " << file;
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kData) << e.what();
    EXPECT_NE(std::string(e.what()).find(file), std::string::npos) << e.what();
    if (!what.empty()) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  }
}

std::vector<uint8_t> read_bytes(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
}
// Overwrites in place and then sets the length: truncating to 0 first would make ext4 flush
// on close (auto_da_alloc), and the fuzz test rewrites files thousands of times.
void write_bytes(const std::string& p, const std::vector<uint8_t>& b) {
  const int fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
  ASSERT_GE(fd, 0) << p;
  ASSERT_EQ(::pwrite(fd, b.data(), b.size(), 0), ssize_t(b.size())) << p;
  ASSERT_EQ(::ftruncate(fd, off_t(b.size())), 0) << p;
  ::close(fd);
}
template <class T>
void poke(const std::string& p, size_t offset, T value) {
  auto b = read_bytes(p);
  std::memcpy(b.data() + offset, &value, sizeof value);
  write_bytes(p, b);
}
template <class T>
T peek(const std::string& p, size_t offset) {
  const auto b = read_bytes(p);
  T v;
  std::memcpy(&v, b.data() + offset, sizeof v);
  return v;
}

nlohmann::json read_index(const std::string& dir) {
  std::ifstream f(dir + "/index.json");
  return nlohmann::json::parse(f);
}
void write_index(const std::string& dir, const nlohmann::json& j) {
  std::ofstream(dir + "/index.json") << j.dump(1);
}

TEST_F(ShardsTest, RoundTripAcrossManySmallShards) {
  const auto docs = random_docs(1, 60, 12, 259, 0.3);
  const Expected e = concat(docs);
  const std::string dir = path("corpus");
  const CorpusInfo w = write_corpus(dir, docs, 259, 17);
  EXPECT_EQ(w.n_tokens, int64_t(e.tokens.size()));
  EXPECT_EQ(w.n_docs, 60);
  EXPECT_TRUE(w.has_loss_mask);

  const TokenCorpus c(dir);
  EXPECT_EQ(c.info().tokenizer, "test");
  EXPECT_EQ(c.info().vocab_size, 259);
  EXPECT_EQ(c.info().n_docs, 60);
  EXPECT_TRUE(c.info().has_loss_mask);
  expect_reads_match(c, e);
  c.verify_checksums();

  // index.json: per-shard counts add up to the totals; no shard is over the limit unless it
  // holds a single document; documents never span shards.
  const auto j = read_index(dir);
  EXPECT_EQ(j["format"], "shardlm-tokens");
  EXPECT_EQ(j["token_bytes"], 2);
  EXPECT_EQ(j["n_tokens"], w.n_tokens);
  EXPECT_EQ(j["n_docs"], 60);
  ASSERT_GT(j["shards"].size(), 5u);
  int64_t tokens = 0, n_docs = 0;
  bool any_mask = false;
  for (const auto& s : j["shards"]) {
    const int64_t nt = s["n_tokens"], nd = s["n_docs"];
    EXPECT_TRUE(nt <= 17 || nd == 1) << s.dump();
    tokens += nt;
    n_docs += nd;
    any_mask = any_mask || s["has_loss_mask"].get<bool>();
    const std::string file = dir + "/" + s["file"].get<std::string>();
    const bool mask = s["has_loss_mask"];
    EXPECT_EQ(fs::file_size(file), uint64_t(64 + 2 * nt + 8 * (nd + 1) + (mask ? nt : 0)));
  }
  EXPECT_EQ(tokens, w.n_tokens);
  EXPECT_EQ(n_docs, 60);
  EXPECT_TRUE(any_mask);
  // Only the corpus is left behind: no temporary files.
  for (const auto& entry : fs::directory_iterator(dir))
    EXPECT_EQ(entry.path().string().find(".tmp"), std::string::npos) << entry.path();
}

TEST_F(ShardsTest, ShardsWithoutMaskReadAsAllTargets) {
  // One masked document in the middle: only its shard carries a mask.
  std::vector<Doc> docs = random_docs(2, 9, 5, 259, 0.0);
  docs[4].mask.assign(docs[4].tokens.size(), 0);
  const std::string dir = path("corpus");
  write_corpus(dir, docs, 259, 10);
  const TokenCorpus c(dir);
  EXPECT_TRUE(c.info().has_loss_mask);
  expect_reads_match(c, concat(docs));
  int masked_shards = 0;
  const auto index = read_index(dir);
  for (const auto& s : index["shards"]) masked_shards += s["has_loss_mask"].get<bool>();
  EXPECT_EQ(masked_shards, 1);

  const std::string plain = path("plain");
  write_corpus(plain, random_docs(3, 9, 5, 259, 0.0), 259, 10);
  EXPECT_FALSE(TokenCorpus(plain).info().has_loss_mask);
}

TEST_F(ShardsTest, TokenWidthFollowsVocabSize) {
  for (const int64_t vocab : {int64_t(65536), int64_t(65537), int64_t(1) << 20}) {
    const std::string dir = path(fmt::format("v{}", vocab));
    std::vector<Doc> docs = random_docs(uint64_t(vocab), 20, 9, int32_t(vocab), 0.5);
    docs[0].tokens[0] = int32_t(vocab - 1);  // the largest id survives
    docs[1].tokens[0] = 0;
    write_corpus(dir, docs, vocab, 25);
    const uint32_t width = vocab <= 65536 ? 2 : 4;
    EXPECT_EQ(peek<uint32_t>(dir + "/shard_00000.bin", 12), width) << vocab;
    EXPECT_EQ(read_index(dir)["token_bytes"], width);
    const TokenCorpus c(dir);
    EXPECT_EQ(c.info().vocab_size, vocab);
    expect_reads_match(c, concat(docs));
    c.verify_checksums();
  }
}

TEST_F(ShardsTest, LongDocumentGetsAShardOfItsOwn) {
  std::vector<Doc> docs = random_docs(4, 5, 3, 259, 0.0);
  docs[2].tokens.assign(50, 7);
  const std::string dir = path("corpus");
  write_corpus(dir, docs, 259, 8);
  const TokenCorpus c(dir);
  expect_reads_match(c, concat(docs));
  bool found = false;
  const auto index = read_index(dir);
  for (const auto& s : index["shards"])
    if (s["n_tokens"] == 50) found = s["n_docs"] == 1;
  EXPECT_TRUE(found);
}

TEST_F(ShardsTest, OpensALoneShardFile) {
  const auto docs = random_docs(5, 10, 6, 300, 0.5);
  const std::string dir = path("corpus");
  write_corpus(dir, docs, 300, 1000);
  const TokenCorpus c(dir + "/shard_00000.bin");
  EXPECT_EQ(c.info().tokenizer, "");
  EXPECT_EQ(c.info().vocab_size, 300);
  expect_reads_match(c, concat(docs));
  c.verify_checksums();
}

TEST_F(ShardsTest, EmptyCorpusAndRewrite) {
  const std::string dir = path("corpus");
  { ShardWriter(dir, "byte", 259).finish(); }
  const TokenCorpus empty(dir);
  EXPECT_EQ(empty.info().n_tokens, 0);
  EXPECT_TRUE(empty.doc_starts().empty());
  // A second corpus in the same directory replaces the first: no stale shards remain.
  write_corpus(dir, random_docs(6, 30, 5, 259, 0.0), 259, 8);
  const auto n_big = read_index(dir)["shards"].size();
  const auto docs = random_docs(7, 3, 5, 259, 0.0);
  write_corpus(dir, docs, 259, 1000);
  EXPECT_EQ(read_index(dir)["shards"].size(), 1u);
  EXPECT_GT(n_big, 1u);
  EXPECT_FALSE(fs::exists(dir + "/shard_00001.bin"));
  expect_reads_match(TokenCorpus(dir), concat(docs));
}

TEST_F(ShardsTest, WriterRejectsBadDocuments) {
  ShardWriter w(path("corpus"), "byte", 259);
  const int32_t bad[] = {1, 259};
  EXPECT_THROW(w.add_document(bad, 2), Error);
  const int32_t ok[] = {1, 2};
  const uint8_t bad_mask[] = {1, 2};
  EXPECT_THROW(w.add_document(ok, 2, bad_mask), Error);
  EXPECT_THROW(w.add_document(ok, 0), Error);
}

// A two-shard corpus (the first masked) used by the corruption tests.
class CorruptShardsTest : public ShardsTest {
 protected:
  void SetUp() override {
    ShardsTest::SetUp();
    dir_ = path("corpus");
    std::vector<Doc> docs = random_docs(11, 6, 6, 259, 0.0);
    docs[0].mask.assign(docs[0].tokens.size(), 1);
    write_corpus(dir_, docs, 259, 12);
    shard0_ = dir_ + "/shard_00000.bin";
    shard1_ = dir_ + "/shard_00001.bin";
    ASSERT_TRUE(fs::exists(shard1_));
    TokenCorpus(dir_).verify_checksums();
  }
  void expect_open_fails(const std::string& file, const std::string& what = "") {
    expect_data_error([&] { TokenCorpus c(dir_); }, file, what);
  }
  std::string dir_, shard0_, shard1_;
};

TEST_F(CorruptShardsTest, WrongMagic) {
  poke<char>(shard1_, 0, 'X');
  expect_open_fails(shard1_, "magic");
  expect_data_error([&] { TokenCorpus c(shard1_); }, shard1_, "magic");
}

TEST_F(CorruptShardsTest, HeaderFields) {
  const auto pristine = read_bytes(shard1_);
  struct Case {
    size_t offset;
    uint64_t value;
    size_t bytes;
    const char* what;
  };
  const Case cases[] = {
      {8, 2, 4, "version"},           {12, 4, 4, "token width"},    {12, 3, 4, "token width"},
      {16, 1000, 8, "bytes"},         {16, ~0ull, 8, "cannot fit"}, {24, 1, 8, ""},
      {24, ~0ull >> 1, 8, "fit"},     {32, 4, 4, "flag"},           {40, 70000, 8, "token width"},
      {40, 0, 8, "vocab_size"},       {40, 300, 8, "vocab_size"},   {48, 1, 8, "reserved"},
      {56, 1ull << 60, 8, "reserved"}};
  for (const Case& c : cases) {
    auto b = pristine;
    std::memcpy(b.data() + c.offset, &c.value, c.bytes);
    write_bytes(shard1_, b);
    SCOPED_TRACE(fmt::format("offset {} = {}", c.offset, c.value));
    expect_open_fails(shard1_, c.what);
  }
}

TEST_F(CorruptShardsTest, TruncatedOrExtendedFiles) {
  const auto pristine = read_bytes(shard0_);
  for (size_t len : {size_t(0), size_t(10), size_t(63), size_t(64), pristine.size() - 1}) {
    write_bytes(shard0_, std::vector<uint8_t>(pristine.begin(), pristine.begin() + len));
    SCOPED_TRACE(len);
    expect_open_fails(shard0_, len < 64 ? "truncated" : "");
  }
  auto longer = pristine;
  longer.push_back(0);
  write_bytes(shard0_, longer);
  expect_open_fails(shard0_, "bytes");
  fs::remove(shard0_);
  expect_open_fails(shard0_, "cannot open");
}

TEST_F(CorruptShardsTest, BadDocumentOffsets) {
  const uint64_t n_tokens = peek<uint64_t>(shard1_, 16), n_docs = peek<uint64_t>(shard1_, 24);
  ASSERT_GE(n_docs, 2u);
  const size_t offsets = 64 + 2 * n_tokens;
  const auto pristine = read_bytes(shard1_);
  const std::pair<size_t, uint64_t> cases[] = {{0, 1},                  // first is not 0
                                               {1, 0},                  // an empty document
                                               {1, n_tokens + 5},       // past the end
                                               {n_docs, n_tokens - 1},  // last is not n_tokens
                                               {n_docs, n_tokens + 1}};
  for (const auto& [i, value] : cases) {
    auto b = pristine;
    std::memcpy(b.data() + offsets + 8 * i, &value, 8);
    write_bytes(shard1_, b);
    SCOPED_TRACE(fmt::format("offset[{}] = {}", i, value));
    expect_open_fails(shard1_, "offsets");
  }
}

TEST_F(CorruptShardsTest, ShardsMustMatchIndex) {
  const auto pristine = read_index(dir_);
  auto j = pristine;
  j["shards"][0]["has_loss_mask"] = false;  // the shard has one
  write_index(dir_, j);
  expect_open_fails(shard0_, "loss mask");
  j = pristine;
  j["has_loss_mask"] = false;
  write_index(dir_, j);
  expect_open_fails("index.json", "has_loss_mask");
  j = pristine;
  j["shards"][1]["n_tokens"] = j["shards"][1]["n_tokens"].get<int64_t>() + 1;
  write_index(dir_, j);
  expect_open_fails(shard1_, "index.json says");
  j = pristine;
  j["n_docs"] = 5;
  write_index(dir_, j);
  expect_open_fails("index.json", "documents");
  j = pristine;
  j["vocab_size"] = 260;
  write_index(dir_, j);
  expect_open_fails(shard0_, "vocab_size");
  j = pristine;
  j["shards"][0]["file"] = "../corpus/shard_00000.bin";
  write_index(dir_, j);
  expect_open_fails("index.json", "file name");
  j = pristine;
  j["shards"][1]["file"] = "shard_00007.bin";
  write_index(dir_, j);
  expect_open_fails("shard_00007.bin", "cannot open");
  j = pristine;
  j["n_tokens"] = -1;
  write_index(dir_, j);
  expect_open_fails("index.json", "n_tokens");
  j = pristine;
  j.erase("shards");
  write_index(dir_, j);
  expect_open_fails("index.json", "shards");
  std::ofstream(dir_ + "/index.json") << "{\"format\": ";
  expect_open_fails("index.json", "JSON");
  fs::remove(dir_ + "/index.json");
  expect_open_fails(dir_, "index.json");
}

TEST_F(CorruptShardsTest, ChecksumsCatchPayloadDamage) {
  // Flip a bit of a byte token (< 256), so that the token stays in the vocabulary.
  auto b = read_bytes(shard1_);
  size_t i = 0;
  while (b[64 + 2 * i + 1] != 0) ++i;
  b[64 + 2 * i] ^= 0x01;
  write_bytes(shard1_, b);
  TokenCorpus c(dir_);  // sizes and offsets are fine: opening does not read payloads
  std::vector<int32_t> out(c.info().n_tokens);
  c.read(0, c.info().n_tokens, out.data(), nullptr);
  expect_data_error([&] { c.verify_checksums(); }, shard1_, "CRC-32");
}

TEST_F(CorruptShardsTest, OutOfVocabularyTokensAndMaskBytesFailOnRead) {
  poke<uint16_t>(shard1_, 64, 60000);
  TokenCorpus c(dir_);
  std::vector<int32_t> out(c.info().n_tokens);
  std::vector<uint8_t> mask(c.info().n_tokens);
  expect_data_error([&] { c.read(0, c.info().n_tokens, out.data(), nullptr); }, shard1_,
                    "vocabulary");
  // The first shard's mask sits after its tokens and offsets.
  const uint64_t n_tokens = peek<uint64_t>(shard0_, 16), n_docs = peek<uint64_t>(shard0_, 24);
  poke<uint8_t>(shard0_, 64 + 2 * n_tokens + 8 * (n_docs + 1), 7);
  TokenCorpus c0(dir_ + "/shard_00000.bin");
  expect_data_error([&] { c0.read(0, 1, out.data(), mask.data()); }, shard0_, "mask");
}

// Seeded random mutations of a small valid corpus: byte flips (mostly in headers and
// offsets), truncations and extensions, of shards and of index.json. Opening, reading every
// token and verifying checksums either succeeds with in-range values or throws Error(kData);
// a single mutation of a shard of a corpus directory is always detected.
TEST_F(ShardsTest, RandomMutationsNeverCrash) {
  const std::string dir = path("corpus");
  std::vector<Doc> docs = random_docs(21, 8, 6, 259, 0.0);
  docs[1].mask.assign(docs[1].tokens.size(), 1);
  write_corpus(dir, docs, 259, 15);
  const Expected expected = concat(docs);
  std::vector<std::string> files;
  for (const auto& entry : fs::directory_iterator(dir)) files.push_back(entry.path().string());
  std::sort(files.begin(), files.end());
  ASSERT_GE(files.size(), 3u);  // index.json + at least two shards
  std::vector<std::vector<uint8_t>> pristine;
  for (const auto& f : files) pristine.push_back(read_bytes(f));

  std::mt19937_64 rng(12345);
  int opened = 0, failed = 0;
  std::vector<std::vector<uint8_t>> current = pristine;
  for (int iter = 0; iter < 3000; ++iter) {
    for (size_t i = 0; i < files.size(); ++i)
      if (current[i] != pristine[i]) write_bytes(files[i], current[i] = pristine[i]);
    const int n_mutations = iter % 4 == 0 ? 1 + int(rng() % 4) : 1;
    bool touched_shard = false;
    std::string target_file;
    for (int m = 0; m < n_mutations; ++m) {
      const size_t fi = rng() % files.size();
      auto& b = current[fi];
      const bool is_shard = files[fi].find("index.json") == std::string::npos;
      touched_shard = touched_shard || is_shard;
      target_file = files[fi];
      switch (rng() % 8) {
        case 0:  // truncate
          b.resize(b.empty() ? 0 : rng() % b.size());
          break;
        case 1: {  // extend
          const size_t extra = 1 + rng() % 16;
          for (size_t k = 0; k < extra; ++k) b.push_back(uint8_t(rng()));
          break;
        }
        case 2:  // a random byte anywhere
          if (!b.empty()) b[rng() % b.size()] ^= uint8_t(1 + rng() % 255);
          break;
        case 3:  // a high byte of a header integer: huge counts and widths
          if (b.size() >= 64 && is_shard)
            b[8 + 8 * (rng() % 7) + 7 - rng() % 2] ^= 0x80;
          else if (!b.empty())
            b[rng() % b.size()] ^= 0x20;
          break;
        default:  // a random bit in the header or the first bytes after it
          if (!b.empty()) b[rng() % std::min<size_t>(b.size(), 128)] ^= uint8_t(1u << (rng() % 8));
          break;
      }
      write_bytes(files[fi], b);
    }
    SCOPED_TRACE(fmt::format("iteration {}", iter));
    try {
      TokenCorpus c(dir);
      const int64_t n = c.info().n_tokens;
      ASSERT_LE(n, 1 << 20);
      std::vector<int32_t> out(n);
      std::vector<uint8_t> mask(n);
      c.read(0, n, out.data(), mask.data());
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_TRUE(out[i] >= 0 && out[i] < c.info().vocab_size);
        ASSERT_LE(mask[i], 1);
      }
      int64_t prev = -1;
      for (int64_t s : c.doc_starts()) {
        ASSERT_TRUE(s > prev && s < n);
        prev = s;
      }
      c.verify_checksums();
      // Nothing caught it: then the mutations changed nothing a reader sees.
      ASSERT_FALSE(touched_shard && n_mutations == 1) << "undetected change to " << target_file;
      EXPECT_EQ(out, expected.tokens);
      ++opened;
    } catch (const Error& e) {
      ASSERT_EQ(e.kind(), ErrorKind::kData) << e.what();
      ++failed;
    }
  }
  EXPECT_GT(failed, 2000);
  RecordProperty("undetected_benign", opened);

  // The same on a lone shard file (no index.json to cross-check the header against).
  const std::string lone = files[1];
  const auto lone_pristine = read_bytes(lone);
  for (int iter = 0; iter < 1000; ++iter) {
    auto b = lone_pristine;
    const size_t at = rng() % (iter % 2 ? b.size() : 64);
    b[at] ^= uint8_t(1 + rng() % 255);
    write_bytes(lone, b);
    try {
      TokenCorpus c(lone);
      const int64_t n = c.info().n_tokens;
      ASSERT_LE(n, int64_t(b.size()));
      std::vector<int32_t> out(n);
      std::vector<uint8_t> mask(n);
      c.read(0, n, out.data(), mask.data());
      for (int64_t i = 0; i < n; ++i) ASSERT_TRUE(out[i] >= 0 && out[i] < c.info().vocab_size);
      c.verify_checksums();
    } catch (const Error& e) {
      ASSERT_EQ(e.kind(), ErrorKind::kData) << e.what();
    }
  }
}

}  // namespace
}  // namespace shardlm
