#include "layers/overlap_config.h"

#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <fstream>
#include <initializer_list>
#include <map>
#include <set>
#include <sstream>
#include <tuple>
#include <vector>

namespace tpserve {
namespace {

constexpr std::initializer_list<const char*> kKnobKeys = {
    "mode", "chunks", "comm", "copy_engine", "fast_accum", "in_place", "full_weight"};
// Knobs that were removed: files written before may still carry them (the tuner wrote
// gemm_sm_count: 0 into every entry). Refused with a message that says so rather than as
// unknown keys. Every GEMM now runs on the caller's stream over all SMs, as their defaults
// (0 = all SMs, 1 stream) did, so for such files deleting the line changes nothing.
constexpr std::initializer_list<const char*> kRemovedKnobKeys = {"gemm_sm_count", "gemm_lanes"};
constexpr std::initializer_list<const char*> kCommKeys = {"min_ctas", "max_ctas", "cta_policy",
                                                          "cga_cluster_size"};

std::string Join(std::initializer_list<const char*> a, std::initializer_list<const char*> b = {}) {
  std::string s;
  for (auto list : {a, b}) {
    for (const char* k : list) {
      if (!s.empty()) s += ", ";
      s += k;
    }
  }
  return s;
}

bool In(std::string_view key, std::initializer_list<const char*> list) {
  for (const char* k : list) {
    if (key == k) return true;
  }
  return false;
}

// Reads one YAML document into an OverlapConfig, with errors that say where.
class Parser {
 public:
  explicit Parser(std::string source) : source_(std::move(source)) {}

  Status Error(const YAML::Node& at, const std::string& path, const std::string& what) const {
    const int line = at.IsDefined() && at.Mark().line >= 0 ? at.Mark().line + 1 : 0;
    return InvalidArgumentError(source_ + ":" + std::to_string(line) + ": " + path + ": " + what);
  }

  Status CheckMap(const YAML::Node& node, const std::string& path) const {
    if (!node.IsMap()) return Error(node, path, "must be a mapping");
    return Status::Ok();
  }

  Status CheckKeys(const YAML::Node& node, const std::string& path,
                   std::initializer_list<const char*> allowed,
                   std::initializer_list<const char*> more = {}) const {
    TP_RETURN_IF_ERROR(CheckMap(node, path));
    std::set<std::string> seen;
    for (const auto& kv : node) {
      if (!kv.first.IsScalar()) {
        return Error(kv.first, path,
                     "keys must be plain strings (allowed: " + Join(allowed, more) + ")");
      }
      const std::string key = kv.first.Scalar();
      // yaml-cpp keeps both entries of a repeated key and returns the first:
      // a silent choice, so the repeat is refused.
      if (!seen.insert(key).second) return Error(kv.first, path + "." + key, "duplicate key");
      if (!In(key, allowed) && !In(key, more)) {
        return Error(kv.first, path + "." + key,
                     "unknown key (allowed: " + Join(allowed, more) + ")");
      }
    }
    return Status::Ok();
  }

  // CheckKeys for a map of knobs (kKnobKeys) and `own` keys, refusing removed knobs by name
  // first.
  Status CheckKnobKeys(const YAML::Node& node, const std::string& path,
                       std::initializer_list<const char*> own = {}) const {
    TP_RETURN_IF_ERROR(CheckMap(node, path));
    for (const auto& kv : node) {
      if (kv.first.IsScalar() && In(kv.first.Scalar(), kRemovedKnobKeys)) {
        return Error(kv.first, path + "." + kv.first.Scalar(),
                     "was removed (GEMMs run on one stream over all SMs); delete the key");
      }
    }
    return CheckKeys(node, path, own, kKnobKeys);
  }

  template <typename T>
  Status Read(const YAML::Node& node, const std::string& path, const char* type, T* out) const {
    if (!node.IsScalar()) return Error(node, path, std::string("must be ") + type);
    try {
      *out = node.as<T>();
    } catch (const YAML::Exception&) {
      return Error(node, path, std::string("must be ") + type + ", got '" + node.Scalar() + "'");
    }
    return Status::Ok();
  }

  Status ReadInt(const YAML::Node& node, const std::string& path, int64_t lo, int64_t hi,
                 int64_t* out) const {
    TP_RETURN_IF_ERROR(Read(node, path, "an integer", out));
    if (*out < lo || *out > hi) {
      return Error(node, path,
                   std::to_string(*out) + " is outside [" + std::to_string(lo) + ", " +
                       std::to_string(hi) + "]");
    }
    return Status::Ok();
  }

  // Overrides the knobs present in `node` (a map that may hold other keys).
  Status ReadKnobs(const YAML::Node& node, const std::string& path,
                   OverlapConfig::Setting* s) const {
    if (const YAML::Node v = node["mode"]) {
      std::string mode;
      TP_RETURN_IF_ERROR(Read(v, path + ".mode", "a string", &mode));
      if (mode == "auto") {
        s->auto_mode = true;
      } else {
        auto parsed = ParseOverlapMode(mode);
        if (!parsed.ok()) {
          return Error(v, path + ".mode", "'" + mode + "' (allowed: none, pipeline, ring, auto)");
        }
        s->auto_mode = false;
        s->knobs.mode = *parsed;
      }
    }
    int64_t i = 0;
    if (const YAML::Node v = node["chunks"]) {
      TP_RETURN_IF_ERROR(ReadInt(v, path + ".chunks", 1, 64, &i));
      s->knobs.chunks = static_cast<int>(i);
    }
    if (const YAML::Node v = node["copy_engine"]) {
      TP_RETURN_IF_ERROR(Read(v, path + ".copy_engine", "true or false", &s->knobs.copy_engine));
    }
    if (const YAML::Node v = node["fast_accum"]) {
      TP_RETURN_IF_ERROR(Read(v, path + ".fast_accum", "true or false", &s->knobs.fast_accum));
    }
    if (const YAML::Node v = node["in_place"]) {
      TP_RETURN_IF_ERROR(Read(v, path + ".in_place", "true or false", &s->knobs.in_place));
    }
    if (const YAML::Node v = node["full_weight"]) {
      TP_RETURN_IF_ERROR(Read(v, path + ".full_weight", "true or false", &s->knobs.full_weight));
    }
    if (const YAML::Node c = node["comm"]) {
      const std::string cpath = path + ".comm";
      TP_RETURN_IF_ERROR(CheckKeys(c, cpath, kCommKeys));
      NcclCommConfig& cc = s->knobs.comm;
      const int64_t max = NcclCommConfig::kMaxCtas;
      if (const YAML::Node v = c["min_ctas"]) {
        TP_RETURN_IF_ERROR(ReadInt(v, cpath + ".min_ctas", 0, max, &i));
        cc.min_ctas = static_cast<int>(i);
      }
      if (const YAML::Node v = c["max_ctas"]) {
        TP_RETURN_IF_ERROR(ReadInt(v, cpath + ".max_ctas", 0, max, &i));
        cc.max_ctas = static_cast<int>(i);
      }
      if (const YAML::Node v = c["cga_cluster_size"]) {
        TP_RETURN_IF_ERROR(
            ReadInt(v, cpath + ".cga_cluster_size", 0, NcclCommConfig::kMaxCgaClusterSize, &i));
        cc.cga_cluster_size = static_cast<int>(i);
      }
      if (const YAML::Node v = c["cta_policy"]) {
        std::string name;
        TP_RETURN_IF_ERROR(Read(v, cpath + ".cta_policy", "a string", &name));
        auto p = ParseCtaPolicy(name);
        if (!p.ok()) {
          return Error(v, cpath + ".cta_policy",
                       "'" + name + "' (allowed: default, efficiency, zero)");
        }
        cc.cta_policy = *p;
      }
    }
    if (Status st = s->knobs.comm.Validate(); !st.ok()) return Error(node, path, st.message());
    return Status::Ok();
  }

  StatusOr<OverlapConfig> Run(const YAML::Node& root) {
    OverlapConfig cfg;
    if (!root.IsDefined() || root.IsNull()) return Error(root, "(top)", "empty file");
    TP_RETURN_IF_ERROR(CheckKeys(root, "(top)", {"version", "tp", "defaults", "layers", "tuned"}));
    int64_t version = 0;
    if (!root["version"]) return Error(root, "version", "missing (this loader reads version 1)");
    TP_RETURN_IF_ERROR(ReadInt(root["version"], "version", 1, 1000, &version));
    if (version != OverlapConfig::kVersion) {
      return Error(root["version"], "version",
                   std::to_string(version) + " is not supported (allowed: 1)");
    }
    if (const YAML::Node v = root["tp"]) {
      int64_t tp = 0;
      TP_RETURN_IF_ERROR(ReadInt(v, "tp", 1, 1024, &tp));
      cfg.set_tp(static_cast<int>(tp));
    }
    if (const YAML::Node d = root["defaults"]) {
      TP_RETURN_IF_ERROR(CheckKnobKeys(d, "defaults"));
      TP_RETURN_IF_ERROR(ReadKnobs(d, "defaults", &cfg.mutable_defaults()));
    }
    if (const YAML::Node layers = root["layers"]) {
      if (!layers.IsSequence()) return Error(layers, "layers", "must be a list of rules");
      for (size_t i = 0; i < layers.size(); ++i) {
        const YAML::Node r = layers[i];
        const std::string path = "layers[" + std::to_string(i) + "]";
        TP_RETURN_IF_ERROR(CheckKnobKeys(r, path, {"match", "m_ranges"}));
        OverlapConfig::Rule rule;
        rule.line = r.Mark().line + 1;
        if (!r["match"]) return Error(r, path + ".match", "missing (a glob on the layer name)");
        TP_RETURN_IF_ERROR(Read(r["match"], path + ".match", "a string", &rule.match));
        OverlapConfig::Setting base = cfg.defaults();
        TP_RETURN_IF_ERROR(ReadKnobs(r, path, &base));
        if (const YAML::Node ranges = r["m_ranges"]) {
          if (!ranges.IsSequence() || ranges.size() == 0) {
            return Error(ranges, path + ".m_ranges", "must be a non-empty list");
          }
          for (size_t j = 0; j < ranges.size(); ++j) {
            const YAML::Node g = ranges[j];
            const std::string gpath = path + ".m_ranges[" + std::to_string(j) + "]";
            TP_RETURN_IF_ERROR(CheckKnobKeys(g, gpath, {"m_min", "m_max"}));
            OverlapConfig::Setting s = base;
            s.m_min = 1;
            s.m_max = INT64_MAX;
            if (const YAML::Node v = g["m_min"]) {
              TP_RETURN_IF_ERROR(ReadInt(v, gpath + ".m_min", 1, INT64_MAX, &s.m_min));
            }
            if (const YAML::Node v = g["m_max"]) {
              TP_RETURN_IF_ERROR(ReadInt(v, gpath + ".m_max", 1, INT64_MAX, &s.m_max));
            }
            if (s.m_max < s.m_min) {
              return Error(g, gpath,
                           "m_max " + std::to_string(s.m_max) + " is below m_min " +
                               std::to_string(s.m_min));
            }
            TP_RETURN_IF_ERROR(ReadKnobs(g, gpath, &s));
            for (const OverlapConfig::Setting& other : rule.settings) {
              if (s.m_min <= other.m_max && other.m_min <= s.m_max) {
                return Error(g, gpath,
                             "M range [" + std::to_string(s.m_min) + ", " + RangeEnd(s.m_max) +
                                 "] overlaps [" + std::to_string(other.m_min) + ", " +
                                 RangeEnd(other.m_max) + "] of the same rule");
              }
            }
            rule.settings.push_back(s);
          }
          std::sort(rule.settings.begin(), rule.settings.end(),
                    [](const auto& a, const auto& b) { return a.m_min < b.m_min; });
        } else {
          rule.settings.push_back(base);
        }
        cfg.mutable_rules().push_back(std::move(rule));
      }
    }
    if (const YAML::Node tuned = root["tuned"]) {
      if (!tuned.IsSequence()) return Error(tuned, "tuned", "must be a list");
      // (op, n, k, scheme, m) -> the index of the entry that gave it: a second entry
      // for the same key is an error, not a silent override.
      std::map<std::tuple<int, int64_t, int64_t, int, int64_t>, size_t> seen;
      for (size_t i = 0; i < tuned.size(); ++i) {
        const YAML::Node t = tuned[i];
        const std::string path = "tuned[" + std::to_string(i) + "]";
        TP_RETURN_IF_ERROR(
            CheckKnobKeys(t, path, {"op", "n", "k", "m", "scale_scheme", "median_ms", "none_ms"}));
        OverlapConfig::Tuned e;
        std::string op;
        if (!t["op"] || !t["n"] || !t["k"] || !t["m"]) {
          return Error(t, path, "needs op, n, k and m");
        }
        TP_RETURN_IF_ERROR(Read(t["op"], path + ".op", "a string", &op));
        auto parsed = ParseOverlapOp(op);
        if (!parsed.ok())
          return Error(t["op"], path + ".op", "'" + op + "' (allowed: ag_gemm, gemm_rs)");
        e.op = *parsed;
        TP_RETURN_IF_ERROR(ReadInt(t["n"], path + ".n", 1, INT64_MAX, &e.n));
        TP_RETURN_IF_ERROR(ReadInt(t["k"], path + ".k", 1, INT64_MAX, &e.k));
        TP_RETURN_IF_ERROR(ReadInt(t["m"], path + ".m", 1, INT64_MAX, &e.m));
        if (const YAML::Node v = t["scale_scheme"]) {
          std::string scheme;
          TP_RETURN_IF_ERROR(Read(v, path + ".scale_scheme", "a string", &scheme));
          auto parsed_scheme = ParseGemmScaleScheme(scheme);
          if (!parsed_scheme.ok()) {
            return Error(v, path + ".scale_scheme",
                         "'" + scheme + "' (allowed: per_tensor, per_token_channel, blockwise)");
          }
          e.scale_scheme = *parsed_scheme;
        }
        if (const YAML::Node v = t["median_ms"]) {
          TP_RETURN_IF_ERROR(Read(v, path + ".median_ms", "a number", &e.median_ms));
        }
        if (const YAML::Node v = t["none_ms"]) {
          TP_RETURN_IF_ERROR(Read(v, path + ".none_ms", "a number", &e.none_ms));
        }
        OverlapConfig::Setting s;
        TP_RETURN_IF_ERROR(ReadKnobs(t, path, &s));
        if (s.auto_mode) return Error(t["mode"], path + ".mode", "a tuned entry cannot be auto");
        if (s.knobs.mode == OverlapMode::kNone) s.knobs.chunks = 1;  // chunks do not apply
        if (Status st = ValidateLinearKnobs(s.knobs, e.op); !st.ok()) {
          return Error(t, path, st.message());
        }
        e.knobs = s.knobs;
        const auto key = std::make_tuple(static_cast<int>(e.op), e.n, e.k,
                                         static_cast<int>(e.scale_scheme), e.m);
        if (auto [it, inserted] = seen.emplace(key, i); !inserted) {
          return Error(t, path,
                       "repeats the op, n, k, scale_scheme and m of tuned[" +
                           std::to_string(it->second) + "] (line " +
                           std::to_string(tuned[it->second].Mark().line + 1) +
                           "); keep one entry per shape, scheme and m");
        }
        cfg.AddTuned(e);
      }
    }
    return cfg;
  }

  static std::string RangeEnd(int64_t m) {
    return m == INT64_MAX ? std::string("inf") : std::to_string(m);
  }

 private:
  std::string source_;
};

void EmitKnobs(YAML::Emitter& out, const LinearKnobs& k, bool auto_mode) {
  out << YAML::Key << "mode" << YAML::Value
      << (auto_mode ? std::string("auto") : std::string(OverlapModeName(k.mode)));
  out << YAML::Key << "chunks" << YAML::Value << k.chunks;
  out << YAML::Key << "comm" << YAML::Value << YAML::Flow << YAML::BeginMap;
  out << YAML::Key << "min_ctas" << YAML::Value << k.comm.min_ctas;
  out << YAML::Key << "max_ctas" << YAML::Value << k.comm.max_ctas;
  out << YAML::Key << "cta_policy" << YAML::Value << std::string(CtaPolicyName(k.comm.cta_policy));
  out << YAML::Key << "cga_cluster_size" << YAML::Value << k.comm.cga_cluster_size;
  out << YAML::EndMap;
  out << YAML::Key << "copy_engine" << YAML::Value << k.copy_engine;
  out << YAML::Key << "fast_accum" << YAML::Value << k.fast_accum;
  if (k.in_place) out << YAML::Key << "in_place" << YAML::Value << true;        // written when set
  if (k.full_weight) out << YAML::Key << "full_weight" << YAML::Value << true;  // when set
}

}  // namespace

bool GlobMatch(std::string_view p, std::string_view t) {
  size_t pi = 0, ti = 0, star = std::string_view::npos, mark = 0;
  while (ti < t.size()) {
    if (pi < p.size() && (p[pi] == '?' || p[pi] == t[ti])) {
      ++pi;
      ++ti;
    } else if (pi < p.size() && p[pi] == '*') {
      star = pi++;
      mark = ti;
    } else if (star != std::string_view::npos) {
      pi = star + 1;
      ti = ++mark;
    } else {
      return false;
    }
  }
  while (pi < p.size() && p[pi] == '*') ++pi;
  return pi == p.size();
}

StatusOr<OverlapConfig> OverlapConfig::LoadFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return NotFoundError("overlap config " + path + ": cannot open the file");
  std::stringstream text;
  text << in.rdbuf();
  return Parse(text.str(), path);
}

namespace {

// Where each YAML document starts; every other parse event is ignored.
class DocumentStarts final : public YAML::EventHandler {
 public:
  std::vector<YAML::Mark> marks;
  void OnDocumentStart(const YAML::Mark& mark) override { marks.push_back(mark); }
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
  void OnAlias(const YAML::Mark&, YAML::anchor_t) override {}
  void OnScalar(const YAML::Mark&, const std::string&, YAML::anchor_t,
                const std::string&) override {}
  void OnSequenceStart(const YAML::Mark&, const std::string&, YAML::anchor_t,
                       YAML::EmitterStyle::value) override {}
  void OnSequenceEnd() override {}
  void OnMapStart(const YAML::Mark&, const std::string&, YAML::anchor_t,
                  YAML::EmitterStyle::value) override {}
  void OnMapEnd() override {}
};

}  // namespace

StatusOr<OverlapConfig> OverlapConfig::Parse(std::string_view yaml, const std::string& source) {
  YAML::Node root;
  try {
    root = YAML::Load(std::string(yaml));
    // Load reads the first document and drops the rest: a second one is an
    // error. (Not LoadAll: on some malformed input it never returns, as the
    // fuzzer found; here at most two documents are looked at.)
    std::stringstream in{std::string(yaml)};
    YAML::Parser events(in);
    DocumentStarts starts;
    if (events.HandleNextDocument(starts) && events.HandleNextDocument(starts) &&
        starts.marks.size() > 1) {
      return InvalidArgumentError(source + ":" + std::to_string(starts.marks[1].line + 1) +
                                  ": a second YAML document ('---'); an overlap config is one "
                                  "document");
    }
  } catch (const YAML::ParserException& e) {
    return InvalidArgumentError(source + ":" + std::to_string(e.mark.line + 1) +
                                ": YAML syntax error: " + e.msg);
  }
  Parser parser(source);
  StatusOr<OverlapConfig> parsed = InternalError("not parsed");
  try {
    parsed = parser.Run(root);
  } catch (const YAML::Exception& e) {
    // The parser checks types before converting; this is the backstop that
    // keeps any conversion it missed an error instead of a crash.
    return InvalidArgumentError(source + ":" + std::to_string(e.mark.line + 1) + ": " + e.msg);
  }
  TP_ASSIGN_OR_RETURN(OverlapConfig cfg, std::move(parsed));
  cfg.source_ = source;
  return cfg;
}

void OverlapConfig::AddTuned(const Tuned& t) {
  for (Tuned& e : tuned_) {
    if (e.op == t.op && e.n == t.n && e.k == t.k && e.m == t.m &&
        e.scale_scheme == t.scale_scheme) {
      e = t;
      return;
    }
  }
  tuned_.push_back(t);
}

StatusOr<LinearKnobs> OverlapConfig::Resolve(std::string_view layer_name, OverlapOp op, int64_t n,
                                             int64_t k, int64_t m, int tp,
                                             GemmScaleScheme scheme) const {
  if (tp_ > 0 && tp != tp_) {
    return InvalidArgumentError("overlap config " + source_ +
                                " was made for tp=" + std::to_string(tp_) +
                                ", the model runs with tp=" + std::to_string(tp));
  }
  const Setting* chosen = &defaults_;
  std::string where = source_ + " defaults";
  for (const Rule& rule : rules_) {
    if (!GlobMatch(rule.match, layer_name)) continue;
    auto it = std::find_if(rule.settings.begin(), rule.settings.end(),
                           [&](const Setting& s) { return s.m_min <= m && m <= s.m_max; });
    if (it == rule.settings.end()) continue;
    chosen = &*it;
    where = source_ + ":" + std::to_string(rule.line) + " (match '" + rule.match + "')";
    break;
  }
  LinearKnobs knobs = chosen->knobs;
  if (chosen->auto_mode) {
    knobs = LinearKnobs{};  // no measurement for this shape: sequential
    // The measurement at the largest M not above this one, else the smallest.
    const Tuned* below = nullptr;
    const Tuned* above = nullptr;
    for (const Tuned& t : tuned_) {
      if (t.op != op || t.n != n || t.k != k || t.scale_scheme != scheme) continue;
      if (t.m <= m) {
        if (below == nullptr || t.m > below->m) below = &t;
      } else if (above == nullptr || t.m < above->m) {
        above = &t;
      }
    }
    const Tuned* best = below != nullptr ? below : above;
    if (best != nullptr) knobs = best->knobs;
  }
  // Mode none runs one collective and one GEMM: chunks do not apply. (Only
  // here, on the resolved knobs: a level in mode none passes its inherited
  // chunk count on to inner levels that choose another mode.)
  if (knobs.mode == OverlapMode::kNone) knobs.chunks = 1;
  if (Status s = ValidateLinearKnobs(knobs, op); !s.ok()) {
    return InvalidArgumentError("overlap config " + where + " for layer '" +
                                std::string(layer_name) + "': " + s.message());
  }
  return knobs;
}

std::string OverlapConfig::ToYaml() const {
  YAML::Emitter out;
  out << YAML::BeginMap;
  out << YAML::Key << "version" << YAML::Value << kVersion;
  if (tp_ > 0) out << YAML::Key << "tp" << YAML::Value << tp_;
  out << YAML::Key << "defaults" << YAML::Value << YAML::BeginMap;
  EmitKnobs(out, defaults_.knobs, defaults_.auto_mode);
  out << YAML::EndMap;
  if (!rules_.empty()) {
    out << YAML::Key << "layers" << YAML::Value << YAML::BeginSeq;
    for (const Rule& r : rules_) {
      out << YAML::BeginMap << YAML::Key << "match" << YAML::Value << r.match;
      out << YAML::Key << "m_ranges" << YAML::Value << YAML::BeginSeq;
      for (const Setting& s : r.settings) {
        out << YAML::Flow << YAML::BeginMap;
        out << YAML::Key << "m_min" << YAML::Value << s.m_min;
        if (s.m_max != INT64_MAX) out << YAML::Key << "m_max" << YAML::Value << s.m_max;
        EmitKnobs(out, s.knobs, s.auto_mode);
        out << YAML::EndMap;
      }
      out << YAML::EndSeq << YAML::EndMap;
    }
    out << YAML::EndSeq;
  }
  if (!tuned_.empty()) {
    out << YAML::Key << "tuned" << YAML::Value << YAML::BeginSeq;
    for (const Tuned& t : tuned_) {
      out << YAML::Flow << YAML::BeginMap;
      out << YAML::Key << "op" << YAML::Value << std::string(OverlapOpName(t.op));
      out << YAML::Key << "n" << YAML::Value << t.n << YAML::Key << "k" << YAML::Value << t.k;
      out << YAML::Key << "m" << YAML::Value << t.m;
      if (t.scale_scheme != GemmScaleScheme::kPerTensor) {
        out << YAML::Key << "scale_scheme" << YAML::Value
            << std::string(GemmScaleSchemeName(t.scale_scheme));
      }
      EmitKnobs(out, t.knobs, false);
      out << YAML::Key << "median_ms" << YAML::Value << t.median_ms;
      out << YAML::Key << "none_ms" << YAML::Value << t.none_ms;
      out << YAML::EndMap;
    }
    out << YAML::EndSeq;
  }
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

}  // namespace tpserve
