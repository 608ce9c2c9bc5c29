// tokenize_files and the chat template: blank-line documents of text files, JSONL text and
// chat records (the other record formats: test_formats) (exactly the assistant content and its
// closing <eos> are targets), errors naming file:line, streaming of inputs larger than the writer's
// buffers, and the CLI.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "shardlm/core/check.h"
#include "shardlm/io/shards.h"
#include "shardlm/io/tokenize.h"
#include "test_util.h"

namespace shardlm {
namespace {

namespace fs = std::filesystem;
constexpr int32_t kEos = ByteTokenizer::kEos;

class TokenizeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    root_ = shardlm::test::scratch_root() /
            fmt::format("shardlm_test_tokenize_{}_{}", ::getpid(), info->name());
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override { fs::remove_all(root_); }
  std::string write(const std::string& name, const std::string& text) {
    const std::string p = (root_ / name).string();
    std::ofstream(p, std::ios::binary) << text;
    return p;
  }
  std::string out() const { return (root_ / "corpus").string(); }
  CorpusInfo run(const std::vector<std::string>& inputs, int64_t max_shard_tokens = 1 << 28) {
    std::ostringstream log;
    const CorpusInfo info = tokenize_files(inputs, out(), tok_, log, max_shard_tokens);
    log_ = log.str();
    return info;
  }
  fs::path root_;
  ByteTokenizer tok_;
  std::string log_;
};

struct Corpus {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> mask;
  std::vector<int64_t> doc_starts;
  CorpusInfo info;
};

Corpus read_all(const std::string& dir) {
  TokenCorpus c(dir);
  c.verify_checksums();
  Corpus r;
  r.info = c.info();
  r.tokens.resize(r.info.n_tokens);
  r.mask.resize(r.info.n_tokens);
  c.read(0, r.info.n_tokens, r.tokens.data(), r.mask.data());
  r.doc_starts = c.doc_starts();
  return r;
}

// The documents as strings, "<eos>" standing for the end-of-document token.
std::vector<std::string> documents(const Corpus& c) {
  std::vector<std::string> docs;
  for (size_t d = 0; d < c.doc_starts.size(); ++d) {
    const int64_t end =
        d + 1 < c.doc_starts.size() ? c.doc_starts[d + 1] : int64_t(c.tokens.size());
    std::string s;
    for (int64_t i = c.doc_starts[d]; i < end; ++i)
      s += c.tokens[i] == kEos ? std::string("<eos>") : std::string(1, char(c.tokens[i]));
    docs.push_back(s);
  }
  return docs;
}

// Expects Error(kind) whose message holds `what` and `detail`.
template <class F>
void expect_error(F&& f, ErrorKind kind, const std::string& what, const std::string& detail = "") {
  try {
    f();
    ADD_FAILURE() << "no error; expected " << what;
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(detail), std::string::npos) << e.what();
  }
}

TEST_F(TokenizeTest, TextFileDocumentsAreBlankLineSeparated) {
  const std::string in = write(
      "a.txt", "\n\nfirst line\nsecond line\n\n\n\nthird\r\n\r\n  indented\n \nsame doc\nlast");
  const CorpusInfo info = run({in});
  const Corpus c = read_all(out());
  const std::vector<std::string> want = {"first line\nsecond line\n<eos>", "third\r\n<eos>",
                                         "  indented\n \nsame doc\nlast\n<eos>"};
  EXPECT_EQ(documents(c), want);
  EXPECT_EQ(info.n_docs, 3);
  EXPECT_EQ(info.n_tokens, int64_t(c.tokens.size()));
  EXPECT_EQ(info.tokenizer, "byte");
  EXPECT_EQ(info.vocab_size, 259);
  EXPECT_FALSE(info.has_loss_mask);
  EXPECT_NE(log_.find("3 documents"), std::string::npos) << log_;
}

TEST_F(TokenizeTest, JsonlTextRecords) {
  const std::string in = write("t.jsonl",
                               "{\"text\": \"hello\\n\\nworld\", \"id\": 7}\n"
                               "\n"
                               "{\"text\": \"\"}\n"
                               "  {\"text\": \"caf\\u00e9\"}  \r\n");
  run({in});
  const Corpus c = read_all(out());
  const std::vector<std::string> want = {"hello\n\nworld<eos>", "caf\xc3\xa9<eos>"};
  EXPECT_EQ(documents(c), want);
  EXPECT_FALSE(c.info.has_loss_mask);
}

TEST_F(TokenizeTest, ChatTemplateMasksExactlyTheAssistantContent) {
  const std::string in = write(
      "chat.jsonl",
      R"({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Ciao"}]})"
      "\n"
      R"({"text": "plain"})"
      "\n");
  const CorpusInfo info = run({in});
  EXPECT_TRUE(info.has_loss_mask);
  const Corpus c = read_all(out());
  const std::vector<std::string> want = {
      "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\nHello!<eos><|user|>\nBye\n"
      "<|assistant|>\nCiao<eos>",
      "plain<eos>"};
  ASSERT_EQ(documents(c), want);

  // Targets of the chat: "Hello!" + <eos> and "Ciao" + <eos>, nothing else.
  const std::string& chat = want[0];
  std::string targets;
  int64_t n_targets = 0;
  for (int64_t i = 0; i < c.doc_starts[1]; ++i) {
    if (!c.mask[i]) continue;
    ++n_targets;
    targets += c.tokens[i] == kEos ? std::string("<eos>") : std::string(1, char(c.tokens[i]));
  }
  EXPECT_EQ(targets, "Hello!<eos>Ciao<eos>");
  EXPECT_EQ(n_targets, 6 + 1 + 4 + 1);
  // The targets are where the template puts them.
  const int64_t hello = int64_t(chat.find("Hello!"));
  for (int64_t i = hello; i < hello + 7; ++i) EXPECT_EQ(c.mask[i], 1) << i;
  EXPECT_EQ(c.mask[hello - 1], 0);  // the header's "\n"
  // A text document in a masked corpus is all targets.
  for (int64_t i = c.doc_starts[1]; i < int64_t(c.tokens.size()); ++i) EXPECT_EQ(c.mask[i], 1);
  EXPECT_NE(log_.find("(1 masked)"), std::string::npos) << log_;
  // A chat without an assistant message has nothing to train on: an error, not a document.
  const std::string unanswered =
      write("unanswered.jsonl", R"({"messages": [{"role": "user", "content": "unanswered"}]})");
  expect_error([&] { run({unanswered}); }, ErrorKind::kData,
               unanswered + ":1: ", "no assistant message");
}

TEST_F(TokenizeTest, EncodeChatGenerationPrompt) {
  const std::vector<ChatMessage> msgs = {{"user", "2+2?"}};
  const DocumentTokens d = encode_chat(msgs, tok_, /*generation_prompt=*/true);
  EXPECT_EQ(tok_.decode(d.tokens), "<|user|>\n2+2?\n<|assistant|>\n");
  EXPECT_EQ(d.mask, std::vector<uint8_t>(d.tokens.size(), 0));
  EXPECT_THROW(encode_chat({{"tool", "x"}}, tok_), Error);
}

TEST_F(TokenizeTest, MalformedJsonlLinesNameFileAndLine) {
  const std::string good = "{\"text\": \"ok\"}\n\n";  // lines 1 and 2 (blank)
  const std::pair<const char*, const char*> cases[] = {
      {"{\"text\": \"unterminated}", "not valid JSON"},
      {"[1, 2]", "JSON object"},
      {"{\"id\": 3}", "fits no format: it has the keys \"id\""},
      {"{\"text\": \"a\", \"messages\": []}", "more than one format (messages, text)"},
      {"{\"text\": 5}", "\"text\" must be a string"},
      {"{\"messages\": []}", "non-empty list"},
      {"{\"messages\": [\"hi\"]}", "messages[0] is not an object"},
      {"{\"messages\": [{\"role\": \"tool\", \"content\": \"x\"}]}", "messages[0].role"},
      {"{\"messages\": [{\"role\": \"user\"}]}", "messages[0].content"},
      {"{\"messages\": [{\"role\": \"assistant\", \"content\": \"x\", \"thinking\": 5}]}",
       "messages[0].thinking must be a string"},
      {"{\"messages\": [{\"role\": \"assistant\", \"content\": \"x\", \"thinking\": \"a\", "
       "\"reasoning_content\": \"b\"}]}",
       "both"},
      {"{\"text\": \"\xff\"}", "not valid JSON"}};
  for (const auto& [line, what] : cases) {
    SCOPED_TRACE(line);
    const std::string in = write("bad.jsonl", good + line + "\n" + good);
    expect_error([&] { run({in}); }, ErrorKind::kData, in + ":3: ", what);
  }
}

TEST_F(TokenizeTest, EmptyOrMissingInputs) {
  expect_error([&] { run({}); }, ErrorKind::kConfig, "at least one input");
  const std::string empty = write("empty.txt", "");
  expect_error([&] { run({empty}); }, ErrorKind::kData, empty + ": no documents");
  const std::string blank = write("blank.txt", "\n\n\r\n\n");
  expect_error([&] { run({blank}); }, ErrorKind::kData, blank + ": no documents");
  const std::string blank_jsonl = write("blank.jsonl", "\n{\"text\": \"\"}\n");
  expect_error([&] { run({blank_jsonl}); }, ErrorKind::kData, blank_jsonl + ": no documents");
  const std::string missing = (root_ / "missing.txt").string();
  expect_error([&] { run({missing}); }, ErrorKind::kData, missing + ": cannot open");
  expect_error([&] { run({root_.string()}); }, ErrorKind::kData, "is a directory");
  EXPECT_FALSE(fs::exists(out() + "/index.json"));  // no corpus after a failure
}

TEST_F(TokenizeTest, MultipleInputsInOrderAcrossShards) {
  const std::string a = write("a.txt", "one\n\ntwo\n");
  const std::string b = write("b.jsonl", "{\"text\": \"three\"}\n");
  const CorpusInfo info = run({a, b}, /*max_shard_tokens=*/6);
  EXPECT_EQ(info.n_docs, 3);
  const std::vector<std::string> want = {"one\n<eos>", "two\n<eos>", "three<eos>"};
  EXPECT_EQ(documents(read_all(out())), want);
  EXPECT_TRUE(fs::exists(out() + "/shard_00002.bin"));
  EXPECT_NE(log_.find(a + ": 2 documents"), std::string::npos) << log_;
  EXPECT_NE(log_.find("tokenized 2 files: 3 documents"), std::string::npos) << log_;
}

// Inputs several times the writer's 1 MiB buffers, with a single document longer than a
// buffer and a shard limit that splits the rest: tokens come back exactly.
TEST_F(TokenizeTest, StreamsInputsLargerThanTheBuffers) {
  std::mt19937_64 rng(3);
  std::string text;
  std::vector<int32_t> expected;
  for (int d = 0; d < 4000; ++d) {
    std::string doc;
    const int lines = 1 + int(rng() % 16);
    for (int l = 0; l < lines; ++l) {
      const int len = 1 + int(rng() % 120);
      for (int i = 0; i < len; ++i) doc.push_back(char('a' + rng() % 26));
      doc.push_back('\n');
    }
    if (d == 1000) doc = std::string(1500000, 'x') + "\n";  // one 1.5 MB document
    text += doc + "\n";
    for (char ch : doc) expected.push_back(uint8_t(ch));
    expected.push_back(kEos);
  }
  const std::string in = write("big.txt", text);
  ASSERT_GT(fs::file_size(in), 3u << 20);
  const CorpusInfo info = run({in}, /*max_shard_tokens=*/1 << 19);
  EXPECT_EQ(info.n_docs, 4000);
  const Corpus c = read_all(out());
  ASSERT_EQ(c.tokens.size(), expected.size());
  EXPECT_TRUE(c.tokens == expected);
  EXPECT_TRUE(fs::exists(out() + "/shard_00005.bin"));
}

// Several threads give the same shards, byte for byte, as one: text documents and JSONL
// records (texts, chats, blank lines, empty texts) over several batches and many shards. The
// first malformed line in input order is the one reported, whatever the thread count.
TEST_F(TokenizeTest, ThreadsGiveByteIdenticalShards) {
  std::mt19937_64 rng(5);
  auto words = [&](int n) {
    std::string s;
    for (int i = 0; i < n; ++i) s += std::string(1 + rng() % 9, char('a' + rng() % 26)) + " ";
    return s;
  };
  std::string text, jsonl;
  for (int d = 0; d < 5000; ++d) {
    const int lines = 1 + int(rng() % 4);
    for (int l = 0; l < lines; ++l) text += words(int(rng() % 30)) + (rng() % 7 ? "\n" : "\r\n");
    text += rng() % 5 ? "\n" : "\r\n";
    switch (rng() % 4) {
      case 0:
        jsonl += "\n";
        break;
      case 1:
        jsonl += fmt::format(R"({{"text": "{}"}})", d % 50 ? words(int(rng() % 40)) : "") + "\n";
        break;
      default:
        jsonl += fmt::format(R"({{"messages": [{{"role": "user", "content": "{}"}}, )"
                             R"({{"role": "assistant", "content": "{}"}}]}})",
                             words(int(rng() % 20)), words(int(rng() % 20))) +
                 "\n";
    }
  }
  const std::vector<std::string> inputs = {write("a.txt", text), write("b.jsonl", jsonl)};
  auto corpus = [&](int threads) {
    const std::string dir = (root_ / fmt::format("corpus_{}", threads)).string();
    std::ostringstream log;
    tokenize_files(inputs, dir, tok_, log, /*max_shard_tokens=*/1 << 16, threads);
    return dir;
  };
  const std::string one = corpus(1);
  EXPECT_GT(read_all(one).info.n_docs, 8000);
  EXPECT_TRUE(fs::exists(one + "/shard_00005.bin"));
  for (int threads : {2, 3, 7}) {
    SCOPED_TRACE(threads);
    shardlm::test::expect_same_files(one, corpus(threads));
  }
  // Two bad lines in the same batch and one in the next: the first is named.
  std::string bad = jsonl;
  for (const int at : {2500, 2600, 4900}) {
    size_t pos = 0;
    for (int l = 1; l < at; ++l) pos = bad.find('\n', pos) + 1;
    bad.insert(pos, "{oops}\n");
  }
  const std::string bad_path = write("bad.jsonl", bad);
  for (int threads : {1, 3}) {
    std::ostringstream log;
    expect_error([&] { tokenize_files({bad_path}, out(), tok_, log, 1 << 16, threads); },
                 ErrorKind::kData, bad_path + ":2500: not valid JSON");
  }
  std::ostringstream log;
  expect_error([&] { tokenize_files({bad_path}, out(), tok_, log, 1 << 16, 0); },
               ErrorKind::kConfig, "threads must be >= 1");
}

TEST_F(TokenizeTest, LoadTokenizer) {
  EXPECT_EQ(load_tokenizer("")->vocab_size(), 259);
  EXPECT_EQ(load_tokenizer("byte")->name(), "byte");
  // Neither "byte" nor an existing tokenizer file (or a directory holding one).
  expect_error([] { load_tokenizer("models/tokenizer.json"); }, ErrorKind::kConfig,
               "no such file or directory; give \"byte\", a directory holding tokenizer.json");
}

TEST_F(TokenizeTest, CommandLine) {
  if (!fs::exists(SHARDLM_BINARY)) GTEST_SKIP() << "the shardlm binary is not built";
  const std::string in = write("c.jsonl", R"({"messages": [{"role": "user", "content": "q"},)"
                                          R"( {"role": "assistant", "content": "a"}]})"
                                          "\n");
  const std::string log = (root_ / "log.txt").string();
  const std::string cmd =
      fmt::format("{} tokenize --input {} --output {} > {} 2>&1", SHARDLM_BINARY, in, out(), log);
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  EXPECT_TRUE(read_all(out()).info.has_loss_mask);
  const std::string bad = write("bad.jsonl", "{\"text\": 1}\n");
  const int rc = std::system(
      fmt::format("{} tokenize --input {} --output {} > {} 2>&1", SHARDLM_BINARY, bad, out(), log)
          .c_str());
  EXPECT_EQ(WEXITSTATUS(rc), 3);
  std::ifstream f(log);
  const std::string err((std::istreambuf_iterator<char>(f)), {});
  EXPECT_NE(err.find(bad + ":1:"), std::string::npos) << err;
}

}  // namespace
}  // namespace shardlm
