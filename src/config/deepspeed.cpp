// DeepSpeed ds_config.json -> shardlm --set overrides, with the policy of deepspeed.h: each
// DeepSpeed key is mapped, warned about or rejected by name. This file only translates; the
// values it produces go through the config loader's own checks (config.cpp), and errors there
// about a key set from here name the DeepSpeed key it came from (deepspeed_load.cpp).
#include "shardlm/config/deepspeed.h"

#include "json_show.h"

#include <fmt/format.h>

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string_view>

#include "deepspeed_keys.h"
#include "shardlm/core/check.h"
#include "shardlm/parallel/topology.h"

namespace shardlm {
namespace {

using nlohmann::json;
using namespace deepspeed_keys;

// DeepSpeed sizes its buckets in elements; shardlm's bucket keys count bytes of f32 gradients.
constexpr int64_t kBytesPerBucketElement = 4;
// DeepSpeed's WarmupCosineLR floor when cos_min_ratio is not given.
constexpr double kDeepSpeedCosMinRatio = 0.0001;

bool is_auto(const json& v) { return v.is_string() && v.get_ref<const std::string&>() == "auto"; }

std::string sub(std::string_view parent, std::string_view key) {
  return fmt::format("{}.{}", parent, key);
}

// Whether a value asks for anything: false, null, "auto", {} and {"enabled": false} do not.
bool asks_for_something(const json& v, std::string_view quiet) {
  if (v.is_null() || is_auto(v)) return false;
  if (!quiet.empty()) {
    const json q = json::parse(quiet);
    if (v == q) return false;
    if (v.is_number() && q.is_number() && v.get<double>() == q.get<double>()) return false;
    return true;
  }
  if (v.is_boolean()) return v.get<bool>();
  if (v.is_object()) {
    if (auto it = v.find("enabled"); it != v.end() && it->is_boolean()) return it->get<bool>();
    return !v.empty();
  }
  return true;
}

const KnownKey* find_in(std::string_view key, std::span<const KnownKey> table) {
  for (const KnownKey& k : table)
    if (k.key == key) return &k;
  return nullptr;
}

class Mapper {
 public:
  Mapper(const RunConfig& base, int64_t world_size) : base_(base) { out_.world_size = world_size; }

  DeepSpeedMapping run(const json& ds) {
    if (!ds.is_object())
      SHARDLM_FAIL(ErrorKind::kConfig, "a DeepSpeed config must be a JSON object, got {}",
                   ds.type_name());
    // bf16 before fp16 does not matter: fp16 enabled is an error either way.
    for (const auto& [key, value] : ds.items()) top_level(key, value);
    finish_schedule();
    finish_batch();
    return std::move(out_);
  }

 private:
  // ---- typed readers: std::nullopt for "auto" (keep shardlm's value) -------------------------

  std::optional<int64_t> integer(const json& v, const std::string& path, int64_t min) {
    if (is_auto(v)) return std::nullopt;
    // DeepSpeed configs write sizes as 5e8: integral floats are integers.
    constexpr double kMax = 9.0e15;  // exact in a double, far past any real size
    double d = 0;
    if (v.is_number_integer() || v.is_number_unsigned() || v.is_number_float()) d = v.get<double>();
    if (!v.is_number() || std::trunc(d) != d || d < static_cast<double>(min) || d > kMax)
      SHARDLM_FAIL(ErrorKind::kConfig, "{} must be an integer >= {} or \"auto\", got {}", path, min,
                   quote_json(v));
    return v.is_number_float() ? static_cast<int64_t>(d) : v.get<int64_t>();
  }

  std::optional<double> number(const json& v, const std::string& path) {
    if (is_auto(v)) return std::nullopt;
    if (!v.is_number() || !std::isfinite(v.get<double>()))
      SHARDLM_FAIL(ErrorKind::kConfig, "{} must be a number or \"auto\", got {}", path,
                   quote_json(v));
    return v.get<double>();
  }

  std::optional<bool> boolean(const json& v, const std::string& path) {
    if (is_auto(v)) return std::nullopt;
    if (!v.is_boolean())
      SHARDLM_FAIL(ErrorKind::kConfig, "{} must be true, false or \"auto\", got {}", path,
                   quote_json(v));
    return v.get<bool>();
  }

  const json& object(const json& v, const std::string& path, std::string_view example) {
    if (!v.is_object())
      SHARDLM_FAIL(ErrorKind::kConfig, "{} must be a JSON object such as {}, got {}", path, example,
                   quote_json(v));
    return v;
  }

  // ---- results -------------------------------------------------------------------------------

  void set(std::string_view key, const json& value, std::string source) {
    out_.overrides.push_back(fmt::format("{}={}", key, value.dump()));
    out_.sources.push_back(std::move(source));
  }

  template <typename... Args>
  void warn(fmt::format_string<Args...> format, Args&&... args) {
    out_.warnings.push_back(fmt::format(format, std::forward<Args>(args)...));
  }

  // Warns about (ignored) or rejects a key of a table; false when the key is in neither.
  bool known(const std::string& path, std::string_view key, const json& v,
             std::span<const KnownKey> ignored, std::span<const KnownKey> rejected = {}) {
    if (const KnownKey* k = find_in(key, ignored)) {
      if (asks_for_something(v, k->quiet))
        warn("{} ({}) is ignored: {}", path, quote_json(v), k->why);
      return true;
    }
    if (const KnownKey* k = find_in(key, rejected)) {
      if (asks_for_something(v, k->quiet))
        SHARDLM_FAIL(ErrorKind::kConfig, "{} ({}) is not supported: {}", path, quote_json(v),
                     k->why);
      return true;
    }
    return false;
  }

  // ---- sections ------------------------------------------------------------------------------

  void top_level(const std::string& key, const json& v) {
    if (key == "train_batch_size") {
      train_batch_ = integer(v, key, 1);
    } else if (key == "train_micro_batch_size_per_gpu") {
      micro_batch_ = integer(v, key, 1);
    } else if (key == "gradient_accumulation_steps") {
      grad_accum_ = integer(v, key, 1);
    } else if (key == "gradient_clipping") {
      if (auto clip = number(v, key)) set("train.grad_clip", *clip, key);
    } else if (key == "steps_per_print") {
      if (auto every = integer(v, key, 1)) set("log.every_steps", *every, key);
    } else if (key == "bf16" || key == "bfloat16") {
      bf16(v, key);
    } else if (key == "fp16") {
      fp16(v);
    } else if (key == "optimizer") {
      optimizer(v);
    } else if (key == "scheduler") {
      scheduler_ = &object(v, key, R"({"type": "WarmupCosineLR", "params": {...}})");
    } else if (key == "tensorboard") {
      tensorboard(object(v, key, R"({"enabled": true, "output_path": "runs/tb/"})"));
    } else if (key == "zero_optimization") {
      zero(object(v, key, R"({"stage": 2})"));
    } else if (key == "tensor_parallel") {
      tensor_parallel(object(v, key, R"({"autotp_size": 2})"));
    } else if (key == "communication_data_type") {
      communication_data_type(v, key);
    } else if (key == "sequence_parallel_size") {
      if (auto cp = integer(v, key, 1)) {
        set("parallel.cp", *cp, key);
        if (*cp > 1) set("parallel.cp_kind", "ulysses", key);
        cp_ = *cp;
      }
    } else if (!known(key, key, v, kIgnoredTopLevel, kRejectedTopLevel)) {
      warn("'{}' is not a DeepSpeed key shardlm knows; it is ignored", key);
    }
  }

  // DeepSpeed's TensorBoard monitor: enabled, output_path and job_name (the event files go to
  // output_path/job_name, as DeepSpeed writes them).
  void tensorboard(const json& v) {
    std::string dir, job;
    for (const auto& [key, value] : v.items()) {
      const std::string p = sub("tensorboard", key);
      if (key == "enabled") {
        if (auto on = boolean(value, p)) set("log.tensorboard", *on, p);
      } else if (key == "output_path" || key == "job_name") {
        if (!value.is_string())
          SHARDLM_FAIL(ErrorKind::kConfig, "{} must be a string, got {}", p, quote_json(value));
        (key == "output_path" ? dir : job) = value.get<std::string>();
      } else {
        warn("'{}' is not a DeepSpeed key shardlm knows; it is ignored", p);
      }
    }
    if (!dir.empty() || !job.empty())
      set("log.tensorboard_dir", (std::filesystem::path(dir) / job).string(), "tensorboard");
  }

  void bf16(const json& v, const std::string& path) {
    object(v, path, R"({"enabled": true})");
    for (const auto& [key, value] : v.items()) {
      const std::string p = sub(path, key);
      if (key == "enabled") {
        if (auto on = boolean(value, p)) set("precision.param", *on ? "bf16" : "fp32", p);
      } else if (asks_for_something(value, "")) {
        warn(
            "{} ({}) is ignored: shardlm keeps f32 master weights, f32 Adam moments and f32 "
            "gradient accumulation with bf16",
            p, quote_json(value));
      }
    }
  }

  // The gradient reductions' wire format: "fp32" or "bf16" (zero.reduce_dtype); fp16 is not one.
  void communication_data_type(const json& v, const std::string& path) {
    if (is_auto(v) || v.is_null()) return;
    const std::string type = v.is_string() ? v.get<std::string>() : "";
    if (type == "fp32" || type == "bf16") return set("zero.reduce_dtype", type, path);
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "{} must be \"fp32\" or \"bf16\" (zero.reduce_dtype), got {}: shardlm reduces "
                 "gradients in fp32 or, from ZeRO stage 2, in bf16",
                 path, quote_json(v));
  }

  void fp16(const json& v) {
    object(v, "fp16", R"({"enabled": false})");
    // The other fp16 keys (loss_scale, initial_scale_power, ...) only apply when it is enabled.
    if (auto it = v.find("enabled"); it != v.end() && boolean(*it, "fp16.enabled").value_or(false))
      SHARDLM_FAIL(ErrorKind::kConfig,
                   "fp16.enabled is true: fp16 training with loss scaling is not supported; use "
                   "bf16 instead (\"bf16\": {{\"enabled\": true}}, or precision.param = \"bf16\"), "
                   "which has fp32's range and needs no loss scaling");
  }

  void optimizer(const json& v) {
    object(v, "optimizer", R"({"type": "AdamW", "params": {"lr": 1e-4}})");
    const auto type_it = v.find("type");
    if (type_it == v.end() || !type_it->is_string())
      SHARDLM_FAIL(ErrorKind::kConfig,
                   "optimizer.type must be \"Adam\" or \"AdamW\" (shardlm trains with AdamW), "
                   "got {}",
                   type_it == v.end() ? std::string("nothing") : quote_json(*type_it));
    std::string type = type_it->get<std::string>();
    for (char& c : type) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (type != "adam" && type != "adamw")
      SHARDLM_FAIL(ErrorKind::kConfig,
                   "optimizer.type {} is not supported: shardlm trains with AdamW; use \"AdamW\" "
                   "(or \"Adam\"), or remove the optimizer section to keep shardlm's train.* "
                   "settings",
                   quote_json(*type_it));
    // DeepSpeed's "Adam" decouples the weight decay unless adam_w_mode is false; "AdamW" always.
    bool decoupled = true;
    std::optional<double> weight_decay;
    for (const auto& [key, value] : v.items()) {
      if (key == "type") continue;
      if (key != "params") {
        warn("'optimizer.{}' is not a DeepSpeed optimizer key shardlm knows; it is ignored", key);
        continue;
      }
      object(value, "optimizer.params", R"({"lr": 1e-4, "betas": [0.9, 0.95]})");
      for (const auto& [name, param] : value.items()) {
        const std::string p = sub("optimizer.params", name);
        if (name == "lr") {
          optimizer_lr_ = number(param, p);
        } else if (name == "betas") {
          betas(param, p);
        } else if (name == "eps") {
          if (auto eps = number(param, p)) set("train.eps", *eps, p);
        } else if (name == "weight_decay") {
          weight_decay = number(param, p);
          if (weight_decay) set("train.weight_decay", *weight_decay, p);
        } else if (name == "adam_w_mode") {
          if (type == "adam" && !boolean(param, p).value_or(true)) decoupled = false;
        } else if (name == "amsgrad") {
          if (boolean(param, p).value_or(false))
            SHARDLM_FAIL(ErrorKind::kConfig,
                         "{} is true: AMSGrad is not supported; shardlm's AdamW keeps the plain "
                         "second moment. Remove it",
                         p);
        } else if (name == "bias_correction") {
          if (!boolean(param, p).value_or(true))
            SHARDLM_FAIL(ErrorKind::kConfig,
                         "{} is false: shardlm's AdamW always corrects the moments' bias. Remove "
                         "it",
                         p);
        } else if (name == "maximize") {
          if (boolean(param, p).value_or(false))
            SHARDLM_FAIL(ErrorKind::kConfig, "{} is true: shardlm minimizes the loss", p);
        } else if (!known(p, name, param, kIgnoredOptimizerParams)) {
          SHARDLM_FAIL(ErrorKind::kConfig,
                       "{} is not a parameter of shardlm's AdamW (lr, betas, eps, weight_decay); "
                       "remove it",
                       p);
        }
      }
    }
    if (!decoupled && weight_decay.value_or(base_.train.weight_decay) != 0)
      SHARDLM_FAIL(ErrorKind::kConfig,
                   "optimizer.params.adam_w_mode is false: Adam would add the weight decay ({}) "
                   "to the gradient (L2), but shardlm's AdamW decouples it; use type \"AdamW\", or "
                   "weight_decay 0",
                   weight_decay.value_or(base_.train.weight_decay));
  }

  void betas(const json& v, const std::string& path) {
    if (is_auto(v)) return;
    if (!v.is_array() || v.size() != 2)
      SHARDLM_FAIL(ErrorKind::kConfig, "{} must be [beta1, beta2] or \"auto\", got {}", path,
                   quote_json(v));
    if (auto b1 = number(v[0], path + "[0]")) set("train.beta1", *b1, path + "[0]");
    if (auto b2 = number(v[1], path + "[1]")) set("train.beta2", *b2, path + "[1]");
  }

  void zero(const json& z) {
    for (const auto& [key, value] : z.items()) {
      const std::string p = sub("zero_optimization", key);
      if (key == "stage") {
        if (auto stage = integer(value, p, 0)) {
          if (*stage > 3)
            SHARDLM_FAIL(ErrorKind::kConfig, "{} must be 0, 1, 2 or 3, got {}", p, *stage);
          set("zero.stage", *stage, p);
        }
      } else if (key == "offload_optimizer") {
        offload(value, p, "zero.offload_optimizer");
      } else if (key == "offload_param") {
        offload(value, p, "zero.offload_params");
      } else if (key == "cpu_offload") {  // deprecated spelling of offload_optimizer cpu
        if (auto on = boolean(value, p)) set("zero.offload_optimizer", *on ? "cpu" : "none", p);
      } else if (key == "cpu_offload_params") {
        if (auto on = boolean(value, p)) set("zero.offload_params", *on ? "cpu" : "none", p);
      } else if (key == "overlap_comm") {
        if (auto on = boolean(value, p)) set("zero.overlap_comm", *on, p);
      } else if (key == "reduce_bucket_size") {
        bucket(value, p, "zero.reduce_bucket_bytes");
      } else if (key == "allgather_bucket_size") {
        bucket(value, p, "zero.allgather_bucket_bytes");
      } else if (!known(p, key, value, kIgnoredZero, kRejectedZero)) {
        warn("'{}' is not a ZeRO key shardlm knows; it is ignored", p);
      }
    }
  }

  void bucket(const json& v, const std::string& path, std::string_view key) {
    constexpr int64_t kMaxElements = int64_t{1} << 50;
    const auto elements = integer(v, path, 1);
    if (!elements) return;
    if (*elements > kMaxElements)
      SHARDLM_FAIL(ErrorKind::kConfig, "{} ({} elements) is larger than any bucket can be", path,
                   *elements);
    set(key, *elements * kBytesPerBucketElement,
        fmt::format("{} ({} elements x {} bytes)", path, *elements, kBytesPerBucketElement));
  }

  void offload(const json& v, const std::string& path, std::string_view key) {
    object(v, path, R"({"device": "cpu"})");
    std::string device;
    if (auto it = v.find("device"); it != v.end() && !is_auto(*it) && !it->is_null()) {
      const std::string p = sub(path, "device");
      if (!it->is_string())
        SHARDLM_FAIL(ErrorKind::kConfig, "{} must be \"cpu\" or \"none\", got {}", p,
                     quote_json(*it));
      device = it->get<std::string>();
      if (device == "nvme")
        SHARDLM_FAIL(ErrorKind::kConfig,
                     "{} \"nvme\" is not supported: shardlm offloads to host memory only; use "
                     "\"cpu\" (and `shardlm plan` to check that host memory suffices)",
                     p);
      if (device != "cpu" && device != "none")
        SHARDLM_FAIL(ErrorKind::kConfig, "{} must be \"cpu\" or \"none\", got {}", p,
                     quote_json(*it));
      set(key, device, p);
    }
    for (const auto& [name, value] : v.items()) {
      if (name == "device") continue;
      const std::string p = sub(path, name);
      // Tuning of an offload that is off asks for nothing.
      if (device == "none") continue;
      if (!known(p, name, value, kIgnoredOffload))
        warn("'{}' is not an offload key shardlm knows; it is ignored", p);
    }
  }

  void tensor_parallel(const json& v) {
    for (const auto& [key, value] : v.items()) {
      const std::string p = sub("tensor_parallel", key);
      if (key == "autotp_size" || key == "tp_size") {
        if (auto tp = integer(value, p, 1)) {
          set("parallel.tp", *tp, p);
          tp_ = *tp;
        }
      } else if (asks_for_something(value, "")) {
        warn("{} ({}) is ignored: shardlm's tensor parallelism is set by parallel.tp alone", p,
             quote_json(value));
      }
    }
  }

  // After the optimizer: the schedule's peak and floor depend on its learning rate.
  void finish_schedule() {
    if (scheduler_ == nullptr) {
      if (optimizer_lr_) set("train.lr", *optimizer_lr_, "optimizer.params.lr");
      return;
    }
    const std::string type = scheduler_type(*scheduler_);
    const json& params = scheduler_params(*scheduler_);
    const bool cosine = type == "WarmupCosineLR";
    const double lr = schedule_peak(params, cosine);
    const int64_t warmup = schedule_warmup(params);
    for (const auto& [key, value] : params.items())
      schedule_parameter(key, value, type, cosine, warmup);
    if (!find_param(params, "warmup_type") && warmup > 0)
      warn(
          "scheduler.params.warmup_type is not set, and DeepSpeed's default \"log\" warmup is "
          "approximated: shardlm warms up linearly (set \"warmup_type\": \"linear\")");
    schedule_floor(params, type, lr);
  }

  // The scheduler's type: one of the three whose shape shardlm's warmup-then-cosine covers.
  std::string scheduler_type(const json& scheduler) {
    const auto type_it = scheduler.find("type");
    const std::string type =
        type_it != scheduler.end() && type_it->is_string() ? type_it->get<std::string>() : "";
    if (type != "WarmupLR" && type != "WarmupDecayLR" && type != "WarmupCosineLR")
      SHARDLM_FAIL(ErrorKind::kConfig,
                   "scheduler.type {} is not supported: shardlm's schedule is a linear warmup "
                   "then a cosine decay to train.min_lr; use \"WarmupCosineLR\", "
                   "\"WarmupDecayLR\" or \"WarmupLR\", or remove the scheduler section to keep "
                   "shardlm's train.warmup_steps and train.min_lr",
                   type_it == scheduler.end() ? std::string("(missing)") : quote_json(*type_it));
    return type;
  }

  // The scheduler's "params" object ({} when absent); warns about the section's other keys.
  const json& scheduler_params(const json& scheduler) {
    static const json kNoParams = json::object();
    const json* params = &kNoParams;
    for (const auto& [key, value] : scheduler.items()) {
      if (key == "params")
        params = &object(value, "scheduler.params", R"({"warmup_num_steps": 100})");
      else if (key != "type")
        warn("'scheduler.{}' is not a DeepSpeed scheduler key shardlm knows; it is ignored", key);
    }
    return *params;
  }

  static const json* find_param(const json& params, std::string_view name) {
    const auto it = params.find(name);
    return it == params.end() ? nullptr : &*it;
  }

  // The peak learning rate, set as train.lr: WarmupLR and WarmupDecayLR replace the
  // optimizer's lr by warmup_max_lr. Returns the peak the floor scales (shardlm's own lr when
  // neither gives one).
  double schedule_peak(const json& params, bool cosine) {
    std::optional<double> peak = optimizer_lr_;
    std::string peak_source = "optimizer.params.lr";
    if (const json* max_lr = cosine ? nullptr : find_param(params, "warmup_max_lr")) {
      if (auto lr = number(*max_lr, "scheduler.params.warmup_max_lr")) {
        if (optimizer_lr_ && *optimizer_lr_ != *lr)
          warn(
              "optimizer.params.lr ({}) is replaced by scheduler.params.warmup_max_lr ({}), as "
              "in DeepSpeed",
              *optimizer_lr_, *lr);
        peak = lr;
        peak_source = "scheduler.params.warmup_max_lr";
      }
    }
    if (peak) set("train.lr", *peak, peak_source);
    return peak.value_or(base_.train.lr);
  }

  // The warmup's length, set as train.warmup_steps; shardlm's own when the scheduler has none.
  int64_t schedule_warmup(const json& params) {
    int64_t warmup = base_.train.warmup_steps;
    if (const json* steps = find_param(params, "warmup_num_steps"))
      if (auto n = integer(*steps, "scheduler.params.warmup_num_steps", 0)) {
        set("train.warmup_steps", *n, "scheduler.params.warmup_num_steps");
        warmup = *n;
      }
    return warmup;
  }

  // One scheduler.params key of `type`: checked, and warned about where shardlm's schedule
  // differs from DeepSpeed's. The peak, the warmup's length and the cosine floor are read by
  // their own steps.
  void schedule_parameter(const std::string& key, const json& value, const std::string& type,
                          bool cosine, int64_t warmup) {
    const std::string p = sub("scheduler.params", key);
    if (key == "warmup_max_lr" && !cosine) return;
    if (key == "warmup_num_steps") return;
    if (key == "warmup_type") {
      if (is_auto(value)) return;
      if (!value.is_string() || (value != "log" && value != "linear"))
        SHARDLM_FAIL(ErrorKind::kConfig, "{} must be \"log\" or \"linear\", got {}", p,
                     quote_json(value));
      if (value == "log" && warmup > 0)
        warn("{} \"log\" is approximated: shardlm warms up linearly", p);
    } else if (key == "warmup_min_lr" && !cosine) {
      const auto floor = number(value, p);
      if (floor && *floor > 0)
        warn("{} ({}) is not the warmup's start: shardlm warms up from 0", p, *floor);
      if (floor && type == "WarmupDecayLR") set("train.min_lr", *floor, p);
    } else if (key == "warmup_min_ratio" && cosine) {
      if (const auto ratio = number(value, p); ratio && *ratio > 0)
        warn("{} ({}) is not the warmup's start: shardlm warms up from 0", p, *ratio);
    } else if (key == "cos_min_ratio" && cosine) {
      return;  // schedule_floor
    } else if (key == "total_num_steps" && type != "WarmupLR") {
      const auto total = integer(value, p, 1);
      if (total && *total != base_.train.max_steps)
        warn(
            "{} ({}) is not used: shardlm decays over the whole run (train.max_steps, or the "
            "steps of train.epochs)",
            p, *total);
    } else if (key == "last_batch_iteration") {
      if (asks_for_something(value, "-1"))
        warn(
            "{} ({}) is ignored: shardlm resumes the schedule from its checkpoints "
            "(train.resume)",
            p, quote_json(value));
    } else {
      warn("'{}' is not a parameter of DeepSpeed's {} that shardlm knows; it is ignored", p, type);
    }
  }

  // The floor after the warmup, as train.min_lr: the peak itself for WarmupLR (constant), and
  // cos_min_ratio x the peak for WarmupCosineLR. WarmupDecayLR's floor is its warmup_min_lr.
  void schedule_floor(const json& params, const std::string& type, double lr) {
    if (type == "WarmupLR") {
      set("train.min_lr", lr, "scheduler.type WarmupLR (constant after the warmup)");
    } else if (type == "WarmupDecayLR") {
      warn(
          "scheduler.type WarmupDecayLR decays linearly; shardlm decays along a cosine between "
          "the same end points (train.lr to train.min_lr)");
    } else {
      const json* ratio_json = find_param(params, "cos_min_ratio");
      std::optional<double> ratio = kDeepSpeedCosMinRatio;
      std::string source = "scheduler.params.cos_min_ratio (DeepSpeed's default 0.0001)";
      if (ratio_json) {
        ratio = number(*ratio_json, "scheduler.params.cos_min_ratio");
        source = "scheduler.params.cos_min_ratio";
      }
      if (ratio) {
        if (*ratio < 0 || *ratio > 1)
          SHARDLM_FAIL(ErrorKind::kConfig,
                       "scheduler.params.cos_min_ratio must be in [0, 1], got {}", *ratio);
        set("train.min_lr", *ratio * lr, fmt::format("{} x train.lr {}", source, lr));
      }
    }
  }

  // train_batch_size = micro x accum x dp, deriving a missing factor as DeepSpeed does.
  void finish_batch() {
    if (micro_batch_) set("train.micro_batch", *micro_batch_, "train_micro_batch_size_per_gpu");
    if (grad_accum_) set("train.grad_accum", *grad_accum_, "gradient_accumulation_steps");
    if (!train_batch_) return;
    const int64_t total = *train_batch_;
    out_.train_batch_size = total;
    ParallelDims dims{-1, base_.parallel.pp, cp_.value_or(base_.parallel.cp),
                      tp_.value_or(base_.parallel.tp)};
    const int64_t dp = Topology(dims, out_.world_size, 0).size(Axis::kDp);
    const int64_t micro = micro_batch_.value_or(base_.train.micro_batch);
    const int64_t accum = grad_accum_.value_or(base_.train.grad_accum);
    if (micro < 1 || accum < 1) return;  // invalid in the shardlm config: validate() says so
    const auto from_shardlm = [](bool given, std::string_view key) {
      return given ? std::string() : fmt::format(", shardlm's {}", key);
    };

    if (!micro_batch_ && grad_accum_) {
      const int64_t per_micro = accum * dp;
      if (total % per_micro != 0)
        SHARDLM_FAIL(ErrorKind::kConfig,
                     "train_batch_size ({}) is not a multiple of gradient_accumulation_steps ({}) "
                     "x data-parallel size ({}) = {}, so train_micro_batch_size_per_gpu cannot be "
                     "derived; make train_batch_size a multiple of {}, or set "
                     "train_micro_batch_size_per_gpu",
                     total, accum, dp, per_micro, per_micro);
      set("train.micro_batch", total / per_micro,
          "train_batch_size / (gradient_accumulation_steps x data-parallel size)");
    } else if (!grad_accum_) {
      const int64_t per_step = micro * dp;
      if (total % per_step != 0)
        SHARDLM_FAIL(ErrorKind::kConfig,
                     "train_batch_size ({}) is not a multiple of train_micro_batch_size_per_gpu "
                     "({}{}) x data-parallel size ({}) = {}, so gradient_accumulation_steps cannot "
                     "be derived; make train_batch_size a multiple of {}, or set "
                     "gradient_accumulation_steps",
                     total, micro, from_shardlm(micro_batch_.has_value(), "train.micro_batch"), dp,
                     per_step, per_step);
      set("train.grad_accum", total / per_step,
          "train_batch_size / (train_micro_batch_size_per_gpu x data-parallel size)");
    } else if (micro * accum * dp != total) {
      SHARDLM_FAIL(ErrorKind::kConfig,
                   "train_batch_size ({}) must equal train_micro_batch_size_per_gpu ({}) x "
                   "gradient_accumulation_steps ({}) x data-parallel size ({}) = {}; fix one of "
                   "them, or set train_batch_size to \"auto\"",
                   total, micro, accum, dp, micro * accum * dp);
    }
  }

  const RunConfig& base_;
  DeepSpeedMapping out_;
  std::optional<int64_t> train_batch_, micro_batch_, grad_accum_, tp_, cp_;
  std::optional<double> optimizer_lr_;
  const json* scheduler_ = nullptr;
};

}  // namespace

DeepSpeedMapping map_deepspeed_config(const nlohmann::json& ds, const RunConfig& base,
                                      int64_t world_size) {
  return Mapper(base, world_size).run(ds);
}

}  // namespace shardlm
