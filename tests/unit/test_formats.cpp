// The record formats (io/records.cpp) and their reader (io/record_reader.cpp): each format's ids
// and loss mask against the tools that define it (format_reference.py: transformers'
// apply_chat_template on LLaMA-Factory's conversion for messages, alpaca and ShareGPT; TRL's
// SFTTrainer for prompt/completion), JSON arrays read as the same records as JSON Lines,
// mapped column names and tags, bad records named by file, line and field (or counted with
// skip_bad_records), and the `shardlm tokenize` options and exit codes.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "shardlm/core/check.h"
#include "shardlm/io/bpe.h"
#include "shardlm/io/records.h"
#include "shardlm/io/tokenize.h"
#include "test_util.h"
#include "tokenizer_reference.h"

namespace shardlm {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

std::string script(const std::string& name) {
  return std::string(SHARDLM_SOURCE_DIR) + "/tests/unit/" + name;
}

class FormatsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    root_ = test::scratch_root() / fmt::format("formats_{}", info->name());
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  std::string write(const std::string& name, const std::string& text) {
    const std::string p = (root_ / name).string();
    std::ofstream(p, std::ios::binary) << text;
    return p;
  }
  std::string jsonl(const std::string& name, const std::vector<json>& records) {
    std::string text;
    for (const json& r : records) text += r.dump() + "\n";
    return write(name, text);
  }
  // Every document of `path`, in order.
  std::vector<DocumentTokens> read(const std::string& path, const Tokenizer& tok,
                                   const RecordOptions& options = {}, FileStats* stats = nullptr,
                                   int threads = 2) {
    std::vector<DocumentTokens> docs;
    const FileStats s = read_documents(path, tok, options, threads,
                                       [&](const DocumentTokens& d) { docs.push_back(d); });
    if (stats) *stats = s;
    return docs;
  }
  fs::path root_;
  ByteTokenizer byte_;
};

// Expects Error(kind) whose message holds each of `parts`.
template <class F>
void expect_error(F&& f, ErrorKind kind, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "no error; expected " << parts.front();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    for (const std::string& p : parts)
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what() << "\nwant: " << p;
  }
}

// Records of every format, with the features each reads: a system prompt (column or turn),
// history, an empty or missing input, several turns, text and conversational prompts.
std::vector<json> reference_records() {
  return {
      {{"messages",
        {{{"role", "system"}, {"content", "Be terse."}},
         {{"role", "user"}, {"content", "What is light?"}},
         {{"role", "assistant"}, {"content", "Light was made on the first day."}}}}},
      {{"instruction", "Name the first day's work."},
       {"input", "In the beginning"},
       {"output", "God created the heaven and the earth."}},
      {{"instruction", "Say where the darkness was."}, {"input", ""}, {"output", "Upon the deep."}},
      {{"instruction", "And then?"},
       {"output", "Let there be light."},
       {"system", "You quote Genesis."},
       {"history",
        json::array({json::array({"Who spoke?", "God."}), json::array({"When?", "Then."})})}},
      {{"instruction", ""}, {"input", "only an input"}, {"output", "still answered"}},
      {{"conversations",
        {{{"from", "system"}, {"value", "Answer briefly."}},
         {{"from", "human"}, {"value", "Was it good?"}},
         {{"from", "gpt"}, {"value", "It was good."}},
         {{"from", "human"}, {"value", "And the evening?"}},
         {{"from", "gpt"}, {"value", "The evening and the morning were the first day."}}}}},
      {{"messages",
        {{{"from", "human"}, {"value", "Divided what?"}},
         {{"from", "gpt"}, {"value", "The light from the darkness."}}}},
       {"system", "From the top-level column."}},
      {{"prompt", "And God said, Let there be"}, {"completion", " light: and there was light."}},
      {{"prompt", "In the beginning God creat"}, {"completion", "ed the heaven"}},
      {{"prompt", "Firmament"}, {"completion", " in the midst of the waters<|endoftext|>"}},
      {{"prompt",
        {{{"role", "system"}, {"content", "Be brief."}},
         {{"role", "user"}, {"content", "What was called Day?"}}}},
       {"completion", {{{"role", "assistant"}, {"content", "The light."}}}}},
      {{"prompt", {{{"role", "user"}, {"content", "And Night?"}}}},
       {"completion",
        {{{"role", "assistant"}, {"content", "The darkness."}},
         {{"role", "user"}, {"content", "More?"}},
         {{"role", "assistant"}, {"content", "The evening and the morning."}}}}},
  };
}

std::string format_of(const json& record) {
  if (record.contains("prompt")) return "prompt_completion";
  if (record.contains("instruction")) return "alpaca";
  if (record.contains("conversations") || record["messages"][0].contains("from")) return "sharegpt";
  return "messages";
}

// Each format's ids and mask equal the reference's; a document adds the closing eos (mask 0)
// when the reference's ids do not end with it.
TEST_F(FormatsTest, EachFormatMatchesItsReference) {
  const std::string python = test::venv_python("transformers,trl,datasets");
  if (python.empty())
    SHARDLM_MISSING_REFERENCE(test::venv_skip_reason("transformers,trl,datasets"));
  const fs::path dir =
      test::reference_tokenizer_dir(python, script("bpe_reference.py"), "formats_qwen3", "qwen3");
  const auto tok = BpeTokenizer::from_file((dir / "tokenizer.json").string());
  ASSERT_EQ(chat_template_for(*tok), ChatTemplate::kQwen3);
  const std::vector<json> records = reference_records();
  json cases = json::array();
  for (const json& r : records) cases.push_back({{"format", format_of(r)}, {"record", r}});
  std::ofstream(dir / "cases.json") << cases.dump();
  test::run_command(python + " " + script("format_reference.py") + " render " + dir.string() + " " +
                        (dir / "cases.json").string() + " " + (dir / "ref.json").string(),
                    dir / "ref.log");
  std::ifstream ref_file(dir / "ref.json");
  ASSERT_TRUE(ref_file);
  const json ref = json::parse(ref_file);
  ASSERT_EQ(ref.size(), records.size());
  // Read through the file reader with format auto (the keys pick each record's format).
  const std::vector<DocumentTokens> docs = read(jsonl("all.jsonl", records), *tok);
  ASSERT_EQ(docs.size(), records.size());
  for (size_t k = 0; k < records.size(); ++k) {
    SCOPED_TRACE(records[k].dump());
    std::vector<int32_t> ids = ref[k]["ids"].get<std::vector<int32_t>>();
    std::vector<uint8_t> mask = ref[k]["mask"].get<std::vector<uint8_t>>();
    if (ids.back() != tok->eos_id()) {
      ids.push_back(tok->eos_id());
      mask.push_back(0);
    }
    EXPECT_EQ(docs[k].tokens, ids) << tok->decode(docs[k].tokens) << "\nvs\n" << tok->decode(ids);
    EXPECT_EQ(docs[k].mask, mask) << tok->decode(docs[k].tokens);
    EXPECT_GT(std::count(mask.begin(), mask.end(), 1), 0);
  }
}

// With the byte tokenizer's plain template: where the mask falls in each format.
TEST_F(FormatsTest, MasksFallOnTheCompletionOnly) {
  auto text_of = [&](const DocumentTokens& d, bool targets) {
    std::string s;
    for (size_t i = 0; i < d.tokens.size(); ++i)
      if (d.mask[i] == uint8_t(targets))
        s += d.tokens[i] == ByteTokenizer::kEos ? std::string("<eos>")
                                                : std::string(1, char(d.tokens[i]));
    return s;
  };
  const std::vector<DocumentTokens> docs =
      read(jsonl("plain.jsonl",
                 {{{"instruction", "Add"}, {"input", "2+2"}, {"output", "4"}},
                  {{"prompt", "2+2="}, {"completion", "4"}},
                  {{"conversations",
                    {{{"from", "human"}, {"value", "hi"}}, {{"from", "gpt"}, {"value", "yo"}}}}}}),
           byte_);
  ASSERT_EQ(docs.size(), 3u);
  EXPECT_EQ(text_of(docs[0], true), "4<eos>");
  EXPECT_EQ(text_of(docs[0], false), "<|user|>\nAdd\n2+2\n<|assistant|>\n");
  EXPECT_EQ(text_of(docs[1], true), "4<eos>");  // TRL's eos after the completion
  EXPECT_EQ(text_of(docs[1], false), "2+2=");
  EXPECT_EQ(text_of(docs[2], true), "yo<eos>");
}

// A JSON array (pretty-printed, records over many lines) is the same records as JSON Lines; a
// bad record in it is named by the line where it starts and its index.
TEST_F(FormatsTest, JsonArrayEqualsJsonLines) {
  const std::vector<json> records = {{{"text", "a [bracket] and a \"quote\" , comma"}},
                                     {{"instruction", "x}y]"}, {"output", "\\\"}"}},
                                     {{"prompt", "p"}, {"completion", "c\nd"}}};
  const std::vector<DocumentTokens> lines = read(jsonl("r.jsonl", records), byte_);
  const std::string array = write("r.json", "\n  " + json(records).dump(2) + "\n\n");
  const std::vector<DocumentTokens> from_array = read(array, byte_);
  ASSERT_EQ(from_array.size(), lines.size());
  for (size_t i = 0; i < lines.size(); ++i) {
    EXPECT_EQ(from_array[i].tokens, lines[i].tokens) << i;
    EXPECT_EQ(from_array[i].mask, lines[i].mask) << i;
  }
  // A .json file of JSON Lines is read as such.
  EXPECT_EQ(read(write("lines.json", json(records[0]).dump() + "\n"), byte_)[0].tokens,
            lines[0].tokens);
  // Record 2 starts on line 4: [, {record 0}, {record 1}, {bad}.
  const std::string bad = write("bad.json",
                                "[\n{\"text\": \"a\"},\n{\"text\": \"b\"},\n{\"instruction\": "
                                "\"i\",\n \"output\": \"\"}\n]\n");
  expect_error([&] { read(bad, byte_); }, ErrorKind::kData,
               {bad + ":4: record 2: ", "\"output\" must be a non-empty string"});
  const std::pair<const char*, const char*> broken[] = {
      {"[{\"text\": \"a\"}", "no closing ']'"},
      {"[{\"text\": \"a\"}] x", "text after the JSON array"},
      {"[{\"text\": \"a\"}}]", "closes nothing"},
      {"[{\"text\": \"a\"},\n{\"text\" \"b\"}]", ":2: record 1: not valid JSON"}};
  for (const auto& [text, what] : broken) {
    SCOPED_TRACE(text);
    const std::string p = write("broken.json", text);
    expect_error([&] { read(p, byte_); }, ErrorKind::kData, {p + ":", what});
  }
  expect_error([&] { read(write("empty.json", " [ ] "), byte_); }, ErrorKind::kData,
               {"no documents"});
}

// The malformed records of each format: Error(kData) naming the file, the line and the field.
TEST_F(FormatsTest, BadRecordsNameFileLineAndField) {
  const std::string good = R"({"text": "fine"})";
  struct Case {
    std::string record, what;
    RecordFormat format = RecordFormat::kAuto;
  };
  const std::vector<Case> cases = {
      {R"({"id": 1, "body": "x"})", R"(fits no format: it has the keys "body", "id")"},
      {R"({"text": "a", "output": "b", "instruction": "c"})",
       "more than one format (alpaca, text)"},
      {R"([1])", "a record must be a JSON object"},
      {R"({"instruction": "i", "output": ""})", R"("output" must be a non-empty string)"},
      {R"({"instruction": "i", "output": 3})", R"("output" must be a non-empty string, not 3)"},
      {R"({"instruction": 1, "output": "o"})", R"("instruction" must be a string)"},
      {R"({"instruction": "", "input": "", "output": "o"})", "both empty"},
      {R"({"instruction": "i", "input": [], "output": "o"})", R"("input" must be a string)"},
      {R"({"instruction": "i", "output": "o", "history": [["q"]]})", R"("history"[0] must be)"},
      {R"({"instruction": "i", "output": "o", "system": 5})", R"("system" must be a string)"},
      {R"({"output": "o"})", R"("instruction" must be a string (it is missing))",
       RecordFormat::kAlpaca},
      {R"({"conversations": []})", R"("conversations" must be a non-empty list)"},
      {R"({"conversations": [{"from": "human", "value": "q"}]})",
       R"("conversations" ends without a "gpt" turn)"},
      {R"({"conversations": [{"from": "gpt", "value": "a"}, {"from": "human", "value": "q"}]})",
       R"(conversations[0].from is "gpt" where "human" is due)"},
      {R"({"conversations": [{"from": "human", "value": "q"}, {"from": "human", "value": "q"}]})",
       R"(conversations[1].from is "human" where "gpt" is due)"},
      {R"({"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": "f"}]})",
       R"(conversations[1].from is "function_call": not "human", "gpt" or "system")"},
      {R"({"conversations": [{"from": "human", "value": "q"}, {"from": "system", "value": "s"}]})",
       "a system turn may only come first"},
      {R"({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": ""}]})",
       R"(conversations[1].value must be a non-empty string)"},
      {R"({"conversations": [{"from": "human"}, {"from": "gpt", "value": "a"}]})",
       R"(conversations[0].value must be a string (it is missing))"},
      {R"({"messages": [{"role": "user", "content": "q"}]})",
       R"("messages" has no assistant message)"},
      {R"({"messages": [{"role": "tool", "content": "q"}]})", "messages[0].role"},
      {R"({"prompt": "p", "completion": ""})", R"("completion" must be a non-empty string)"},
      {R"({"prompt": "p", "completion": [{"role": "assistant", "content": "c"}]})",
       "must both be strings (text) or both lists"},
      {R"({"prompt": [{"role": "user", "content": "p"}], "completion": [{"role": "user", "content": "c"}]})",
       R"("completion" must end with an assistant message)"},
      {R"({"prompt": [], "completion": [{"role": "assistant", "content": "c"}]})",
       R"("prompt" must be a non-empty list)"},
      {R"({"text": 5})", R"("text" must be a string)"},
      {R"({"instruction": "i", "output": "o"})", R"("text" must be a string (it is missing))",
       RecordFormat::kText},
      {R"({"text": "unterminated)", "not valid JSON"}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.record);
    const std::string fine =
        c.format == RecordFormat::kAlpaca ? R"({"instruction": "i", "output": "o"})" : good;
    const std::string p = write("bad.jsonl", fine + "\n\n" + c.record + "\n" + fine + "\n");
    RecordOptions o;
    o.format = c.format;
    expect_error([&] { read(p, byte_, o); }, ErrorKind::kData, {p + ":3: ", c.what});
  }
  expect_error([] { parse_record_format("csv", "data.format"); }, ErrorKind::kConfig,
               {"data.format: unknown record format \"csv\"", "sharegpt"});
}

// skip_bad_records counts the bad records per file, keeps the first messages, writes the rest.
TEST_F(FormatsTest, SkipBadRecordsCountsThem) {
  std::string text;
  for (int i = 0; i < 12; ++i)
    text += i % 2 ? R"({"instruction": "q", "output": ""})"
                    "\n"
                  : R"({"instruction": "q", "output": "a"})"
                    "\n";
  const std::string p = write("mixed.jsonl", text);
  expect_error([&] { read(p, byte_); }, ErrorKind::kData, {p + ":2: "});
  RecordOptions o;
  o.skip_bad_records = true;
  for (const int threads : {1, 3}) {
    FileStats stats;
    const auto docs = read(p, byte_, o, &stats, threads);
    EXPECT_EQ(docs.size(), 6u);
    EXPECT_EQ(stats.docs, 6);
    EXPECT_EQ(stats.masked, 6);
    EXPECT_EQ(stats.bad_records, 6);
    ASSERT_EQ(stats.bad_shown.size(), FileStats::kBadRecordsShown);
    EXPECT_EQ(stats.bad_shown[0], p + ":2: \"output\" must be a non-empty string");
    EXPECT_EQ(stats.bad_shown[1].rfind(p + ":4: ", 0), 0u);
    const std::string line = describe_file(p, stats);
    EXPECT_NE(line.find("6 bad records skipped"), std::string::npos) << line;
    EXPECT_NE(line.find(stats.bad_shown[4]), std::string::npos) << line;
  }
  std::ostringstream log;
  tokenize_files({p}, (root_ / "corpus").string(), byte_, log, 1 << 20, 2, o);
  EXPECT_NE(log.str().find(", 6 bad records skipped ->"), std::string::npos) << log.str();
  // A file of bad records only has no documents.
  const std::string all_bad = write("all_bad.jsonl", R"({"x": 1})"
                                                     "\n");
  expect_error([&] { read(all_bad, byte_, o); }, ErrorKind::kData, {"1 bad records skipped"});
}

// Mapped columns and tags read the same documents as the default names.
TEST_F(FormatsTest, ColumnsAndTagsMapOtherNames) {
  const auto base =
      read(jsonl("base.jsonl",
                 {{{"instruction", "Q"}, {"output", "A"}, {"system", "S"}},
                  {{"conversations",
                    {{{"from", "human"}, {"value", "hi"}}, {{"from", "gpt"}, {"value", "yo"}}}}}}),
           byte_);
  RecordOptions o;
  o.columns.instruction = "question";
  o.columns.output = "answer";
  o.columns.system = "persona";
  o.columns.messages = "turns";
  o.tags = {"speaker", "text", "user", "assistant", "sys"};
  const auto mapped =
      read(jsonl("mapped.jsonl", {{{"question", "Q"}, {"answer", "A"}, {"persona", "S"}},
                                  {{"turns",
                                    {{{"speaker", "user"}, {"text", "hi"}},
                                     {{"speaker", "assistant"}, {"text", "yo"}}}}}}),
           byte_, o);
  ASSERT_EQ(mapped.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(mapped[i].tokens, base[i].tokens) << i;
    EXPECT_EQ(mapped[i].mask, base[i].mask) << i;
  }
  // Under mapped names the error names the mapped field.
  const std::string p = jsonl("bad.jsonl", {{{"question", "Q"}, {"answer", ""}}});
  expect_error([&] { read(p, byte_, o); }, ErrorKind::kData,
               {p + ":1: ", "\"answer\" must be a non-empty string"});
}

// `shardlm tokenize`: the format options, exit code 3 naming file, line and field, and
// --skip-bad-records.
TEST_F(FormatsTest, CommandLine) {
  if (!fs::exists(SHARDLM_BINARY)) GTEST_SKIP() << "the shardlm binary is not built";
  const std::string log = (root_ / "log.txt").string();
  auto run = [&](const std::string& args) {
    const int rc = std::system(fmt::format("{} tokenize {} --output {} > {} 2>&1", SHARDLM_BINARY,
                                           args, (root_ / "corpus").string(), log)
                                   .c_str());
    return WEXITSTATUS(rc);
  };
  auto logged = [&] {
    std::ifstream f(log);
    return std::string((std::istreambuf_iterator<char>(f)), {});
  };
  const std::string qa = jsonl(
      "qa.jsonl", {{{"question", "q"}, {"answer", "a"}}, {{"question", "q"}, {"answer", ""}}});
  EXPECT_EQ(run("--input " + qa), 3);
  EXPECT_NE(logged().find(qa + ":1: the record fits no format"), std::string::npos) << logged();
  const std::string mapped =
      "--format alpaca --column instruction=question --column output=answer --input " + qa;
  EXPECT_EQ(run(mapped), 3);
  EXPECT_NE(logged().find(qa + ":2: \"answer\" must be a non-empty string"), std::string::npos)
      << logged();
  EXPECT_EQ(run(mapped + " --skip-bad-records"), 0) << logged();
  EXPECT_NE(logged().find("1 bad record skipped"), std::string::npos) << logged();
  EXPECT_EQ(run("--format csv --input " + qa), 2);
  EXPECT_EQ(run("--column question --input " + qa), 2);
  EXPECT_NE(logged().find("give FIELD=NAME"), std::string::npos) << logged();
}

}  // namespace
}  // namespace shardlm
