// Unit tests (no GPU needed) for the NCCL bootstrap and configuration code:
// unique-id text form, rank discovery from launcher variables, rendezvous
// addresses, NCCL environment overrides, NcclCommConfig, the TCP unique-id
// rendezvous on 127.0.0.1, and SpawnLocalWorkers.
#include <arpa/inet.h>
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "comm/nccl_bootstrap.h"
#include "comm/nccl_communicator.h"

namespace tpserve {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// An injected environment.
class FakeEnv {
 public:
  FakeEnv(std::initializer_list<std::pair<const std::string, std::string>> vars) : vars_(vars) {}
  EnvLookup Lookup() const {
    return [this](const char* name) -> const char* {
      auto it = vars_.find(name);
      return it == vars_.end() ? nullptr : it->second.c_str();
    };
  }

 private:
  std::map<std::string, std::string> vars_;
};

ncclUniqueId RandomId(uint32_t seed) {
  std::mt19937 rng(seed);
  ncclUniqueId id;
  for (char& c : id.internal) c = static_cast<char>(rng() & 0xff);
  return id;
}

bool SameId(const ncclUniqueId& a, const ncclUniqueId& b) {
  return std::memcmp(a.internal, b.internal, sizeof a.internal) == 0;
}

bool Contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// ---- hex ----------------------------------------------------------------------

TEST(NcclUniqueIdHexTest, RoundTrip) {
  for (uint32_t seed : {1u, 2u, 3u}) {
    const ncclUniqueId id = RandomId(seed);
    const std::string hex = NcclUniqueIdToHex(id);
    ASSERT_EQ(hex.size(), 256u);
    EXPECT_EQ(hex.find_first_not_of("0123456789abcdef"), std::string::npos);
    auto back = NcclUniqueIdFromHex(hex);
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_TRUE(SameId(*back, id));
  }
}

TEST(NcclUniqueIdHexTest, AcceptsUppercase) {
  const ncclUniqueId id = RandomId(7);
  std::string hex = NcclUniqueIdToHex(id);
  for (char& c : hex) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  auto back = NcclUniqueIdFromHex(hex);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_TRUE(SameId(*back, id));
}

TEST(NcclUniqueIdHexTest, WrongLengthSaysExpectedAndActual) {
  for (size_t n : {size_t{0}, size_t{255}, size_t{257}, size_t{512}}) {
    auto r = NcclUniqueIdFromHex(std::string(n, 'a'));
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(Contains(r.status().message(), "expected 256"));
    EXPECT_TRUE(Contains(r.status().message(), "got " + std::to_string(n))) << r.status().message();
  }
}

TEST(NcclUniqueIdHexTest, BadCharacterNamesCharacterAndPosition) {
  std::string hex(256, '0');
  hex[7] = 'g';  // second nibble of byte 3
  auto r = NcclUniqueIdFromHex(hex);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(r.status().message(), "'g'")) << r.status().message();
  EXPECT_TRUE(Contains(r.status().message(), "position 7")) << r.status().message();

  hex = std::string(256, '0');
  hex[100] = '\x01';  // first nibble, not printable
  r = NcclUniqueIdFromHex(hex);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(Contains(r.status().message(), "0x01")) << r.status().message();
  EXPECT_TRUE(Contains(r.status().message(), "position 100")) << r.status().message();
}

TEST(UniqueIdFromEnvTest, ReadsValidatesAndReportsMissing) {
  const ncclUniqueId id = RandomId(11);
  FakeEnv good({{"TPSERVE_NCCL_ID", NcclUniqueIdToHex(id)}});
  auto r = UniqueIdFromEnv(good.Lookup());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(SameId(*r, id));

  FakeEnv none({});
  EXPECT_EQ(UniqueIdFromEnv(none.Lookup()).status().code(), StatusCode::kNotFound);

  FakeEnv bad({{"TPSERVE_NCCL_ID", "abc"}});
  auto b = UniqueIdFromEnv(bad.Lookup());
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(b.status().message(), "TPSERVE_NCCL_ID")) << b.status().message();
}

// ---- rank discovery -------------------------------------------------------------

TEST(RankInfoFromEnvTest, TpserveVariables) {
  FakeEnv env({{"TPSERVE_RANK", "1"}, {"TPSERVE_WORLD_SIZE", "2"}});
  auto r = RankInfoFromEnv(env.Lookup());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->rank, 1);
  EXPECT_EQ(r->world_size, 2);
  EXPECT_EQ(r->local_rank, 1);  // defaults to the rank
  EXPECT_EQ(r->source, "tpserve");

  FakeEnv with_local(
      {{"TPSERVE_RANK", "5"}, {"TPSERVE_WORLD_SIZE", "8"}, {"TPSERVE_LOCAL_RANK", "1"}});
  r = RankInfoFromEnv(with_local.Lookup());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->rank, 5);
  EXPECT_EQ(r->local_rank, 1);
}

TEST(RankInfoFromEnvTest, MpirunVariables) {
  FakeEnv env({{"OMPI_COMM_WORLD_RANK", "3"},
               {"OMPI_COMM_WORLD_SIZE", "4"},
               {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}});
  auto r = RankInfoFromEnv(env.Lookup());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->rank, 3);
  EXPECT_EQ(r->world_size, 4);
  EXPECT_EQ(r->local_rank, 1);
  EXPECT_EQ(r->source, "mpirun");
}

using ::testing::HasSubstr;

TEST(PlanLaunchTest, NoLauncherIsASingleNodeWhoseRankZeroStartsTheOthers) {
  FakeEnv none({});
  auto p = PlanLaunch(RankInfoFromEnv(none.Lookup()), 4);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->role, LaunchPlan::Role::kLeader);
  EXPECT_EQ(p->rank, 0);
  EXPECT_EQ(p->spawn_ranks, (std::vector<int>{1, 2, 3}));
  EXPECT_FALSE(p->fetch_id);
  EXPECT_FALSE(p->id_from_env);
  EXPECT_EQ(p->serve_id_clients, 0);
}

TEST(PlanLaunchTest, SpawnedRankTakesTheIdFromItsEnvironment) {
  FakeEnv env({{"TPSERVE_RANK", "5"}, {"TPSERVE_WORLD_SIZE", "8"}, {"TPSERVE_LOCAL_RANK", "1"}});
  auto p = PlanLaunch(RankInfoFromEnv(env.Lookup()), 8);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->role, LaunchPlan::Role::kWorker);
  EXPECT_EQ(p->rank, 5);
  EXPECT_EQ(p->local_rank, 1);
  EXPECT_TRUE(p->id_from_env);
  EXPECT_FALSE(p->fetch_id);
  EXPECT_TRUE(p->spawn_ranks.empty());
}

TEST(PlanLaunchTest, LeaderWorkerSetPodsStartTheirNodesRanks) {
  // 2 pods x 4 GPUs = TP 8: the leader pod is ranks 0-3, the worker pod 4-7.
  FakeEnv leader(
      {{"LWS_WORKER_INDEX", "0"}, {"LWS_GROUP_SIZE", "2"}, {"TPSERVE_GPUS_PER_NODE", "4"}});
  auto p = PlanLaunch(RankInfoFromEnv(leader.Lookup()), 8);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->role, LaunchPlan::Role::kLeader);
  EXPECT_EQ(p->spawn_ranks, (std::vector<int>{1, 2, 3}));
  EXPECT_EQ(p->serve_id_clients, 1);  // the worker pod's first process
  EXPECT_FALSE(p->fetch_id);

  FakeEnv worker(
      {{"LWS_WORKER_INDEX", "1"}, {"LWS_GROUP_SIZE", "2"}, {"TPSERVE_GPUS_PER_NODE", "4"}});
  p = PlanLaunch(RankInfoFromEnv(worker.Lookup()), 8);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->role, LaunchPlan::Role::kWorker);
  EXPECT_EQ(p->rank, 4);
  EXPECT_EQ(p->local_rank, 0);
  EXPECT_EQ(p->spawn_ranks, (std::vector<int>{5, 6, 7}));
  EXPECT_TRUE(p->fetch_id);
  EXPECT_EQ(p->serve_id_clients, 0);
}

TEST(PlanLaunchTest, MpirunRanksAreEachStartedByTheLauncher) {
  FakeEnv rank0({{"OMPI_COMM_WORLD_RANK", "0"},
                 {"OMPI_COMM_WORLD_SIZE", "4"},
                 {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}});
  auto p = PlanLaunch(RankInfoFromEnv(rank0.Lookup()), 4);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->role, LaunchPlan::Role::kLeader);
  EXPECT_TRUE(p->spawn_ranks.empty());
  EXPECT_EQ(p->serve_id_clients, 3);

  FakeEnv rank3({{"OMPI_COMM_WORLD_RANK", "3"},
                 {"OMPI_COMM_WORLD_SIZE", "4"},
                 {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}});
  p = PlanLaunch(RankInfoFromEnv(rank3.Lookup()), 4);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->role, LaunchPlan::Role::kWorker);
  EXPECT_EQ(p->local_rank, 1);
  EXPECT_TRUE(p->fetch_id);
  EXPECT_TRUE(p->spawn_ranks.empty());
}

TEST(PlanLaunchTest, WorldSizeOtherThanTpAndBadVariablesAreErrors) {
  FakeEnv lws({{"LWS_WORKER_INDEX", "0"}, {"LWS_GROUP_SIZE", "2"}, {"TPSERVE_GPUS_PER_NODE", "4"}});
  auto p = PlanLaunch(RankInfoFromEnv(lws.Lookup()), 4);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(p.status().message(), HasSubstr("lws: 8 ranks"));
  EXPECT_THAT(p.status().message(), HasSubstr("--tp 4"));

  FakeEnv bad({{"TPSERVE_RANK", "x"}, {"TPSERVE_WORLD_SIZE", "2"}});
  p = PlanLaunch(RankInfoFromEnv(bad.Lookup()), 2);
  ASSERT_FALSE(p.ok());
  EXPECT_THAT(p.status().message(), HasSubstr("TPSERVE_RANK"));
}

TEST(RankInfoFromEnvTest, LeaderWorkerSetVariables) {
  FakeEnv env({{"LWS_WORKER_INDEX", "2"}, {"LWS_GROUP_SIZE", "3"}, {"TPSERVE_GPUS_PER_NODE", "4"}});
  auto r = RankInfoFromEnv(env.Lookup());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->rank, 8);
  EXPECT_EQ(r->world_size, 12);
  EXPECT_EQ(r->local_rank, 0);
  EXPECT_EQ(r->source, "lws");

  FakeEnv one_gpu({{"LWS_WORKER_INDEX", "1"}, {"LWS_GROUP_SIZE", "2"}});
  r = RankInfoFromEnv(one_gpu.Lookup());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->rank, 1);
  EXPECT_EQ(r->world_size, 2);
}

TEST(RankInfoFromEnvTest, PrecedenceTpserveThenMpirunThenLws) {
  FakeEnv all({{"TPSERVE_RANK", "1"},
               {"TPSERVE_WORLD_SIZE", "2"},
               {"OMPI_COMM_WORLD_RANK", "3"},
               {"OMPI_COMM_WORLD_SIZE", "4"},
               {"OMPI_COMM_WORLD_LOCAL_RANK", "3"},
               {"LWS_WORKER_INDEX", "0"},
               {"LWS_GROUP_SIZE", "5"}});
  auto r = RankInfoFromEnv(all.Lookup());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->source, "tpserve");
  EXPECT_EQ(r->world_size, 2);

  FakeEnv mpi_lws({{"OMPI_COMM_WORLD_RANK", "3"},
                   {"OMPI_COMM_WORLD_SIZE", "4"},
                   {"OMPI_COMM_WORLD_LOCAL_RANK", "3"},
                   {"LWS_WORKER_INDEX", "0"},
                   {"LWS_GROUP_SIZE", "5"}});
  r = RankInfoFromEnv(mpi_lws.Lookup());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->source, "mpirun");
  EXPECT_EQ(r->rank, 3);
}

TEST(RankInfoFromEnvTest, NothingSetIsNotFoundAndEmptyCountsAsUnset) {
  FakeEnv none({});
  EXPECT_EQ(RankInfoFromEnv(none.Lookup()).status().code(), StatusCode::kNotFound);
  FakeEnv empty({{"TPSERVE_RANK", ""}, {"OMPI_COMM_WORLD_RANK", ""}});
  EXPECT_EQ(RankInfoFromEnv(empty.Lookup()).status().code(), StatusCode::kNotFound);
}

// Each case: environment, and text the error must contain.
struct BadEnvCase {
  std::map<std::string, std::string> vars;
  std::vector<std::string> expect;
};

TEST(RankInfoFromEnvTest, ErrorsNameTheVariableAndValue) {
  const std::vector<BadEnvCase> cases = {
      {{{"TPSERVE_RANK", "abc"}, {"TPSERVE_WORLD_SIZE", "2"}}, {"TPSERVE_RANK='abc'"}},
      {{{"TPSERVE_RANK", "1x"}, {"TPSERVE_WORLD_SIZE", "2"}}, {"TPSERVE_RANK='1x'"}},
      {{{"TPSERVE_RANK", "-1"}, {"TPSERVE_WORLD_SIZE", "2"}}, {"TPSERVE_RANK=-1", "range"}},
      {{{"TPSERVE_RANK", "2"}, {"TPSERVE_WORLD_SIZE", "2"}},
       {"TPSERVE_RANK=2", "TPSERVE_WORLD_SIZE=2"}},
      {{{"TPSERVE_RANK", "0"}, {"TPSERVE_WORLD_SIZE", "0"}}, {"TPSERVE_WORLD_SIZE=0", "range"}},
      {{{"TPSERVE_RANK", "1"}}, {"TPSERVE_WORLD_SIZE", "not set"}},
      {{{"TPSERVE_WORLD_SIZE", "2"}}, {"TPSERVE_RANK", "not set"}},
      {{{"TPSERVE_RANK", "0"}, {"TPSERVE_WORLD_SIZE", "2"}, {"TPSERVE_LOCAL_RANK", "x"}},
       {"TPSERVE_LOCAL_RANK='x'"}},
      {{{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}},
       {"OMPI_COMM_WORLD_LOCAL_RANK", "not set"}},
      {{{"OMPI_COMM_WORLD_RANK", "4"},
        {"OMPI_COMM_WORLD_SIZE", "2"},
        {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}},
       {"OMPI_COMM_WORLD_RANK=4", "OMPI_COMM_WORLD_SIZE=2"}},
      {{{"LWS_WORKER_INDEX", "3"}, {"LWS_GROUP_SIZE", "3"}},
       {"LWS_WORKER_INDEX=3", "LWS_GROUP_SIZE=3"}},
      {{{"LWS_WORKER_INDEX", "0"}}, {"LWS_GROUP_SIZE", "not set"}},
      {{{"LWS_WORKER_INDEX", "0"}, {"LWS_GROUP_SIZE", "2"}, {"TPSERVE_GPUS_PER_NODE", "0"}},
       {"TPSERVE_GPUS_PER_NODE=0"}},
  };
  for (const BadEnvCase& c : cases) {
    const auto lookup = [&c](const char* name) -> const char* {
      auto it = c.vars.find(name);
      return it == c.vars.end() ? nullptr : it->second.c_str();
    };
    auto r = RankInfoFromEnv(lookup);
    ASSERT_FALSE(r.ok()) << "expected an error for " << c.expect[0];
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
    for (const std::string& e : c.expect) {
      EXPECT_TRUE(Contains(r.status().message(), e))
          << "'" << r.status().message() << "' lacks '" << e << "'";
    }
  }
}

// ---- rendezvous address -------------------------------------------------------------

TEST(RendezvousAddressTest, ParseHostPort) {
  auto a = ParseHostPort("node-0.svc:1234");
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(a->host, "node-0.svc");
  EXPECT_EQ(a->port, 1234);
  a = ParseHostPort("[fe80::1]:65535");
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(a->host, "fe80::1");
  EXPECT_EQ(a->port, 65535);

  for (const char* bad : {"node0", "node0:", "node0:0", "node0:65536", "node0:12x", ":123",
                          "::1:80", "[::1]80", "[::1"}) {
    auto r = ParseHostPort(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(Contains(r.status().message(), bad)) << r.status().message();
  }
}

TEST(RendezvousAddressTest, FromEnvPrecedenceAndErrors) {
  FakeEnv both({{"TPSERVE_RENDEZVOUS", "10.0.0.1:4000"}, {"LWS_LEADER_ADDRESS", "leader"}});
  auto a = RendezvousAddressFromEnv(both.Lookup());
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(a->host, "10.0.0.1");
  EXPECT_EQ(a->port, 4000);

  FakeEnv lws({{"LWS_LEADER_ADDRESS", "leader.ns.svc"}});
  a = RendezvousAddressFromEnv(lws.Lookup());
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(a->host, "leader.ns.svc");
  EXPECT_EQ(a->port, kDefaultRendezvousPort);

  FakeEnv lws_port({{"LWS_LEADER_ADDRESS", "leader"}, {"TPSERVE_RENDEZVOUS_PORT", "777"}});
  a = RendezvousAddressFromEnv(lws_port.Lookup());
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(a->port, 777);

  FakeEnv bad_port({{"LWS_LEADER_ADDRESS", "leader"}, {"TPSERVE_RENDEZVOUS_PORT", "70000"}});
  auto r = RendezvousAddressFromEnv(bad_port.Lookup());
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(Contains(r.status().message(), "TPSERVE_RENDEZVOUS_PORT=70000"))
      << r.status().message();

  FakeEnv bad({{"TPSERVE_RENDEZVOUS", "leader"}});
  r = RendezvousAddressFromEnv(bad.Lookup());
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(Contains(r.status().message(), "TPSERVE_RENDEZVOUS")) << r.status().message();

  FakeEnv none({});
  EXPECT_EQ(RendezvousAddressFromEnv(none.Lookup()).status().code(), StatusCode::kNotFound);
}

// ---- NCCL environment overrides ---------------------------------------------------

TEST(NcclEnvOverridesTest, QuietWithTheHostsRequiredSettings) {
  FakeEnv env({{"NCCL_NVLS_ENABLE", "0"}, {"NCCL_COMM_BLOCKING", "0"}, {"NCCL_MAX_CTAS", ""}});
  EXPECT_TRUE(NcclEnvOverrides(NcclCommConfig{}, env.Lookup()).empty());
}

TEST(NcclEnvOverridesTest, NvlsMustBeOff) {
  FakeEnv unset({});
  auto w = NcclEnvOverrides(NcclCommConfig{}, unset.Lookup());
  ASSERT_EQ(w.size(), 1u);
  EXPECT_TRUE(Contains(w[0], "NCCL_NVLS_ENABLE is not set"));

  FakeEnv on({{"NCCL_NVLS_ENABLE", "1"}});
  w = NcclEnvOverrides(NcclCommConfig{}, on.Lookup());
  ASSERT_EQ(w.size(), 1u);
  EXPECT_TRUE(Contains(w[0], "NCCL_NVLS_ENABLE=1"));
}

TEST(NcclEnvOverridesTest, CtaVariablesOverrideConfiguredAndDefaultValues) {
  NcclCommConfig config;
  config.max_ctas = 2;
  config.cta_policy = NcclCommConfig::CtaPolicy::kZero;
  FakeEnv env({{"NCCL_NVLS_ENABLE", "0"},
               {"NCCL_MAX_CTAS", "8"},
               {"NCCL_MIN_CTAS", "4"},
               {"NCCL_CTA_POLICY", "1"},
               {"NCCL_CGA_CLUSTER_SIZE", "2"}});
  const auto w = NcclEnvOverrides(config, env.Lookup());
  ASSERT_EQ(w.size(), 4u);
  const auto find = [&](const std::string& var) {
    for (const std::string& s : w) {
      if (s.rfind(var + "=", 0) == 0) return s;
    }
    return std::string();
  };
  EXPECT_TRUE(Contains(find("NCCL_MAX_CTAS"), "overrides max_ctas=2")) << find("NCCL_MAX_CTAS");
  EXPECT_TRUE(Contains(find("NCCL_MAX_CTAS"), config.Key()));
  EXPECT_TRUE(Contains(find("NCCL_MIN_CTAS"), "NCCL's default min_ctas")) << find("NCCL_MIN_CTAS");
  EXPECT_TRUE(Contains(find("NCCL_CTA_POLICY"), "overrides cta_policy=zero"))
      << find("NCCL_CTA_POLICY");
  EXPECT_TRUE(Contains(find("NCCL_CGA_CLUSTER_SIZE"), "default cga_cluster_size"))
      << find("NCCL_CGA_CLUSTER_SIZE");
}

TEST(NcclEnvOverridesTest, LegacyChannelVariables) {
  NcclCommConfig config;
  config.min_ctas = 1;
  FakeEnv env(
      {{"NCCL_NVLS_ENABLE", "0"}, {"NCCL_MIN_NCHANNELS", "2"}, {"NCCL_MAX_NCHANNELS", "16"}});
  const auto w = NcclEnvOverrides(config, env.Lookup());
  ASSERT_EQ(w.size(), 2u);
  EXPECT_TRUE(Contains(w[0], "NCCL_MIN_NCHANNELS=2 overrides min_ctas=1")) << w[0];
  EXPECT_TRUE(Contains(w[1], "NCCL_MAX_NCHANNELS=16")) << w[1];
}

TEST(NcclEnvOverridesTest, BlockingSplitShareAndWindows) {
  FakeEnv env({{"NCCL_NVLS_ENABLE", "0"},
               {"NCCL_COMM_BLOCKING", "1"},
               {"NCCL_COMM_SPLIT_SHARE_RESOURCES", "0"},
               {"NCCL_WIN_ENABLE", "0"}});
  const auto w = NcclEnvOverrides(NcclCommConfig{}, env.Lookup());
  ASSERT_EQ(w.size(), 3u);
  EXPECT_TRUE(Contains(w[0], "NCCL_COMM_BLOCKING=1")) << w[0];
  EXPECT_TRUE(Contains(w[1], "NCCL_COMM_SPLIT_SHARE_RESOURCES=0")) << w[1];
  EXPECT_TRUE(Contains(w[2], "NCCL_WIN_ENABLE=0")) << w[2];
}

// ---- NcclCommConfig ----------------------------------------------------------------

TEST(NcclCommConfigTest, DefaultsAreValidAndKeyIsCanonical) {
  NcclCommConfig config;
  EXPECT_TRUE(config.Validate().ok());
  EXPECT_EQ(config.Key(), "min_ctas=0,max_ctas=0,cta_policy=default,cga_cluster_size=0");

  NcclCommConfig other;
  other.max_ctas = 2;
  EXPECT_NE(other.Key(), config.Key());
  NcclCommConfig same = other;
  EXPECT_EQ(same.Key(), other.Key());
  EXPECT_EQ(same, other);
  other.cta_policy = NcclCommConfig::CtaPolicy::kZero;
  EXPECT_EQ(other.Key(), "min_ctas=0,max_ctas=2,cta_policy=zero,cga_cluster_size=0");
  NcclCommConfig eff;
  eff.cta_policy = NcclCommConfig::CtaPolicy::kEfficiency;
  eff.cga_cluster_size = 4;
  eff.min_ctas = 1;
  EXPECT_EQ(eff.Key(), "min_ctas=1,max_ctas=0,cta_policy=efficiency,cga_cluster_size=4");
  EXPECT_TRUE(eff.Validate().ok());
}

TEST(NcclCommConfigTest, ValidateNamesFieldAndRange) {
  struct Case {
    NcclCommConfig config;
    std::vector<std::string> expect;
  };
  std::vector<Case> cases(6);
  cases[0].config.min_ctas = 65;
  cases[0].expect = {"min_ctas = 65", "[0, 64]"};
  cases[1].config.max_ctas = -1;
  cases[1].expect = {"max_ctas = -1"};
  cases[2].config.min_ctas = 8;
  cases[2].config.max_ctas = 4;
  cases[2].expect = {"min_ctas = 8", "max_ctas = 4"};
  cases[3].config.cga_cluster_size = 9;
  cases[3].expect = {"cga_cluster_size = 9", "[0, 8]"};
  cases[4].config.cga_cluster_size = -2;
  cases[4].expect = {"cga_cluster_size = -2"};
  cases[5].config.cta_policy = static_cast<NcclCommConfig::CtaPolicy>(7);
  cases[5].expect = {"cta_policy", "7"};
  for (const Case& c : cases) {
    const Status s = c.config.Validate();
    ASSERT_FALSE(s.ok()) << c.expect[0];
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    for (const std::string& e : c.expect) {
      EXPECT_TRUE(Contains(s.message(), e)) << "'" << s.message() << "' lacks '" << e << "'";
    }
  }
  NcclCommConfig bounds;
  bounds.min_ctas = 64;
  bounds.max_ctas = 64;
  bounds.cga_cluster_size = 8;
  EXPECT_TRUE(bounds.Validate().ok());
}

TEST(NcclCommConfigTest, CtaPolicyNamesRoundTrip) {
  for (auto p : {NcclCommConfig::CtaPolicy::kDefault, NcclCommConfig::CtaPolicy::kEfficiency,
                 NcclCommConfig::CtaPolicy::kZero}) {
    auto back = ParseCtaPolicy(CtaPolicyName(p));
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(*back, p);
  }
  auto bad = ParseCtaPolicy("ZERO");
  ASSERT_FALSE(bad.ok());
  EXPECT_TRUE(Contains(bad.status().message(), "default, efficiency, zero"));
}

// ---- TCP rendezvous -----------------------------------------------------------------

// A port that was free a moment ago (nothing listens on it now).
uint16_t FreePort() {
  auto server = UniqueIdServer::Listen(0);
  EXPECT_TRUE(server.ok()) << server.status().ToString();
  return server.ok() ? server->port() : 0;
}

// A TCP connection to 127.0.0.1:port (-1 on failure, errno set).
int ConnectLoopback(uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    const int err = errno;
    ::close(fd);
    errno = err;
    return -1;
  }
  return fd;
}

TEST(RendezvousTest, TwoFetchersGetTheServedId) {
  auto server = UniqueIdServer::Listen(0);
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  ASSERT_NE(server->port(), 0);
  const ncclUniqueId id = RandomId(42);
  const auto deadline = Clock::now() + std::chrono::seconds(5);
  Status served;
  std::thread serve([&] { served = server->Serve(id, 2, deadline); });
  std::vector<StatusOr<ncclUniqueId>> got(2, StatusOr<ncclUniqueId>(InternalError("unset")));
  std::vector<std::thread> fetchers;
  for (int i = 0; i < 2; ++i) {
    fetchers.emplace_back(
        [&, i] { got[i] = FetchUniqueId("127.0.0.1", server->port(), deadline); });
  }
  for (auto& t : fetchers) t.join();
  serve.join();
  EXPECT_TRUE(served.ok()) << served.ToString();
  for (const auto& g : got) {
    ASSERT_TRUE(g.ok()) << g.status().ToString();
    EXPECT_TRUE(SameId(*g, id));
  }
}

TEST(RendezvousTest, FetchFromClosedPortFailsWithinDeadline) {
  const uint16_t port = FreePort();
  ASSERT_NE(port, 0);
  const auto start = Clock::now();
  auto r = FetchUniqueId("127.0.0.1", port, start + milliseconds(300));
  const auto elapsed = Clock::now() - start;
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(Contains(r.status().message(), "127.0.0.1:" + std::to_string(port)))
      << r.status().message();
  EXPECT_GE(elapsed, milliseconds(250));
  EXPECT_LT(elapsed, milliseconds(1500));
}

TEST(RendezvousTest, FetcherRetriesUntilTheServerListens) {
  const uint16_t port = FreePort();
  ASSERT_NE(port, 0);
  const ncclUniqueId id = RandomId(5);
  const auto deadline = Clock::now() + std::chrono::seconds(5);
  StatusOr<ncclUniqueId> got = InternalError("unset");
  std::thread fetcher([&] { got = FetchUniqueId("localhost", port, deadline); });
  std::this_thread::sleep_for(milliseconds(300));
  const Status served = ServeUniqueId(id, port, 1, deadline);
  fetcher.join();
  EXPECT_TRUE(served.ok()) << served.ToString();
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_TRUE(SameId(*got, id));
}

TEST(RendezvousTest, ServerDropsClientsWithoutGreeting) {
  auto server = UniqueIdServer::Listen(0);
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  const uint16_t port = server->port();
  const ncclUniqueId id = RandomId(9);
  const auto deadline = Clock::now() + std::chrono::seconds(5);
  Status served;
  std::thread serve([&] { served = server->Serve(id, 1, deadline); });

  // A stray client (an HTTP probe) connects first and gets nothing.
  const int fd = ConnectLoopback(port);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  const char probe[] = "GET / HTTP/1.0\r\n\r\n";
  ASSERT_EQ(::send(fd, probe, sizeof probe - 1, MSG_NOSIGNAL),
            static_cast<ssize_t>(sizeof probe - 1));
  char buf[16];
  // Closed without a reply: EOF, or a reset because the probe was not read to its end.
  EXPECT_LE(::recv(fd, buf, sizeof buf, 0), 0);
  ::close(fd);

  auto got = FetchUniqueId("127.0.0.1", port, deadline);
  serve.join();
  EXPECT_TRUE(served.ok()) << served.ToString();
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_TRUE(SameId(*got, id));
}

TEST(RendezvousTest, ServeReportsMissingClientsAtTheDeadline) {
  auto server = UniqueIdServer::Listen(0);
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  const ncclUniqueId id = RandomId(3);
  const auto start = Clock::now();
  Status served;
  std::thread serve([&] { served = server->Serve(id, 2, start + milliseconds(500)); });
  auto got = FetchUniqueId("127.0.0.1", server->port(), start + milliseconds(400));
  serve.join();
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(served.code(), StatusCode::kDeadlineExceeded) << served.ToString();
  EXPECT_TRUE(Contains(served.message(), "served 1 of 2")) << served.message();
  EXPECT_LT(Clock::now() - start, milliseconds(1500));
}

// A fetcher whose connection waited in the backlog past its I/O deadline
// closes it and retries. The server used to answer the abandoned connection
// (the write "succeeds"), count it, and stop before the retry was served.
TEST(RendezvousTest, ConnectionClosedByAFetcherThatGaveUpIsNotCounted) {
  auto server = UniqueIdServer::Listen(0);
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  const uint16_t port = server->port();
  const int fd = ConnectLoopback(port);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  ASSERT_EQ(::send(fd, kRendezvousHello, sizeof kRendezvousHello, MSG_NOSIGNAL),
            static_cast<ssize_t>(sizeof kRendezvousHello));
  ::close(fd);  // gave up before Serve() started

  const ncclUniqueId id = RandomId(13);
  const auto deadline = Clock::now() + std::chrono::seconds(3);
  Status served;
  std::thread serve([&] { served = server->Serve(id, 1, deadline); });
  auto got = FetchUniqueId("127.0.0.1", port, deadline);
  serve.join();
  EXPECT_TRUE(served.ok()) << served.ToString();
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_TRUE(SameId(*got, id));
}

TEST(RendezvousTest, ServeRejectsNegativeClientCount) {
  auto server = UniqueIdServer::Listen(0);
  ASSERT_TRUE(server.ok());
  EXPECT_EQ(server->Serve(RandomId(1), -1, Clock::now()).code(), StatusCode::kInvalidArgument);
}

// ---- SpawnLocalWorkers ---------------------------------------------------------------

// Waits for `pid` for at most 10 s; returns its exit status or -1.
int WaitExit(pid_t pid) {
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  while (Clock::now() < deadline) {
    int status = 0;
    const pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    if (r < 0) return -1;
    std::this_thread::sleep_for(milliseconds(10));
  }
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
  return -1;
}

TEST(SpawnLocalWorkersTest, ChildrenGetRankWorldAndIdReplacingInheritedValues) {
  char dir_template[] = "/tmp/tpserve_spawn_XXXXXX";
  const char* dir = ::mkdtemp(dir_template);
  ASSERT_NE(dir, nullptr);
  // Inherited values must be replaced, not duplicated.
  ASSERT_EQ(::setenv("TPSERVE_RANK", "99", 1), 0);
  ASSERT_EQ(::setenv("TPSERVE_NCCL_ID", "stale", 1), 0);
  const ncclUniqueId id = RandomId(77);
  const std::string script = std::string("printf '%s %s %s %s' \"$TPSERVE_RANK\" ") +
                             "\"$TPSERVE_WORLD_SIZE\" \"$TPSERVE_LOCAL_RANK\" " +
                             "\"$TPSERVE_NCCL_ID\" > " + dir + "/rank$TPSERVE_RANK";
  auto pids = SpawnLocalWorkers({"/bin/sh", "-c", script}, 3, id);
  ::unsetenv("TPSERVE_RANK");
  ::unsetenv("TPSERVE_NCCL_ID");
  ASSERT_TRUE(pids.ok()) << pids.status().ToString();
  ASSERT_EQ(pids->size(), 2u);
  for (pid_t pid : *pids) EXPECT_EQ(WaitExit(pid), 0);
  for (int rank = 1; rank <= 2; ++rank) {
    const std::string path = std::string(dir) + "/rank" + std::to_string(rank);
    std::ifstream in(path);
    ASSERT_TRUE(in.good()) << path;
    std::stringstream text;
    text << in.rdbuf();
    EXPECT_EQ(text.str(),
              std::to_string(rank) + " 3 " + std::to_string(rank) + " " + NcclUniqueIdToHex(id));
    ::unlink(path.c_str());
  }
  ::rmdir(dir);
}

// tpserve serve blocks SIGTERM for its signal thread before it spawns the
// ranks; the children must not inherit that, or a worker whose parent died
// (PR_SET_PDEATHSIG SIGTERM) or that an operator stops would live on.
TEST(SpawnLocalWorkersTest, ChildrenStartWithTerminationSignalsUnblocked) {
  sigset_t term, old;
  sigemptyset(&term);
  sigaddset(&term, SIGTERM);
  ASSERT_EQ(::pthread_sigmask(SIG_BLOCK, &term, &old), 0);
  auto pids = SpawnLocalWorkers({"/bin/sleep", "30"}, 2, RandomId(3));
  ASSERT_EQ(::pthread_sigmask(SIG_SETMASK, &old, nullptr), 0);
  ASSERT_TRUE(pids.ok()) << pids.status().ToString();
  ASSERT_EQ(pids->size(), 1u);
  const pid_t pid = pids->front();
  ASSERT_EQ(::kill(pid, SIGTERM), 0);
  int status = 0;
  pid_t r = 0;
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  while ((r = ::waitpid(pid, &status, WNOHANG)) == 0 && Clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(10));
  }
  if (r != pid) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
    FAIL() << "the child ignored SIGTERM for 10 s (it inherited a blocked mask)";
  }
  ASSERT_TRUE(WIFSIGNALED(status)) << "status " << status;
  EXPECT_EQ(WTERMSIG(status), SIGTERM);
}

// Descriptors without FD_CLOEXEC (sockets, files a library opened) used to
// be inherited by every worker.
TEST(SpawnLocalWorkersTest, ChildrenInheritNoDescriptorsBeyondStderr) {
  const int fd = ::open("/dev/null", O_RDONLY);  // no O_CLOEXEC
  ASSERT_GT(fd, 2);
  const std::string script =
      "[ -e /proc/$$/fd/" + std::to_string(fd) + " ] && exit 3; [ -e /proc/$$/fd/2 ] || exit 4";
  auto pids = SpawnLocalWorkers({"/bin/sh", "-c", script}, 2, RandomId(4));
  ASSERT_TRUE(pids.ok()) << pids.status().ToString();
  const Status s = ReapWorkers(*pids, std::chrono::seconds(10));
  EXPECT_TRUE(s.ok()) << s.ToString() << " (status 3: the child inherited fd " << fd << ")";
  EXPECT_EQ(::fcntl(fd, F_GETFD), 0) << "the parent's descriptor must stay open and inheritable";
  ::close(fd);
}

TEST(SpawnLocalWorkersTest, SingleRankStartsNothing) {
  auto pids = SpawnLocalWorkers({"/bin/true"}, 1, RandomId(1));
  ASSERT_TRUE(pids.ok()) << pids.status().ToString();
  EXPECT_TRUE(pids->empty());
}

TEST(SpawnLocalWorkersTest, Errors) {
  EXPECT_EQ(SpawnLocalWorkers({}, 2, RandomId(1)).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(SpawnLocalWorkers({"/bin/true"}, 0, RandomId(1)).status().code(),
            StatusCode::kInvalidArgument);
  auto r = SpawnLocalWorkers({"/nonexistent/tpserve"}, 2, RandomId(1));
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(Contains(r.status().message(), "/nonexistent/tpserve")) << r.status().message();
  EXPECT_TRUE(Contains(r.status().message(), "rank 1")) << r.status().message();
}

// ---- ReapWorkers ------------------------------------------------------------------

TEST(ReapWorkersTest, AllExitZeroIsOk) {
  auto pids = SpawnLocalWorkers({"/bin/sh", "-c", "exit 0"}, 3, RandomId(2));
  ASSERT_TRUE(pids.ok()) << pids.status().ToString();
  const Status s = ReapWorkers(*pids, std::chrono::seconds(10));
  EXPECT_TRUE(s.ok()) << s.ToString();
  // Reaped: nothing is left to wait for.
  for (pid_t pid : *pids) EXPECT_EQ(::waitpid(pid, nullptr, WNOHANG), -1);
}

TEST(ReapWorkersTest, NamesFailedAndKilledWorkersAndBoundsTheWait) {
  // Rank 1 exits 3; rank 2 would sleep a minute and must be killed.
  const std::string script = "[ \"$TPSERVE_RANK\" = 1 ] && exit 3; exec sleep 60";
  auto pids = SpawnLocalWorkers({"/bin/sh", "-c", script}, 3, RandomId(3));
  ASSERT_TRUE(pids.ok()) << pids.status().ToString();
  const auto t0 = Clock::now();
  const Status s = ReapWorkers(*pids, milliseconds(500));
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(5));
  ASSERT_EQ(s.code(), StatusCode::kInternal);
  EXPECT_TRUE(
      Contains(s.message(), "rank 1 (pid " + std::to_string((*pids)[0]) + ") exited with status 3"))
      << s.message();
  EXPECT_TRUE(Contains(s.message(), "rank 2 (pid " + std::to_string((*pids)[1]) +
                                        ") did not exit in time and was killed"))
      << s.message();
  for (pid_t pid : *pids) EXPECT_EQ(::waitpid(pid, nullptr, WNOHANG), -1);
}

TEST(ReapWorkersTest, NoWorkersIsOk) { EXPECT_TRUE(ReapWorkers({}, milliseconds(0)).ok()); }

// milliseconds::max() used to wrap to a deadline in the past: the workers
// were killed at once instead of being waited for.
TEST(ReapWorkersTest, HugeTimeoutWaitsInsteadOfKillingAtOnce) {
  auto pids = SpawnLocalWorkers({"/bin/sh", "-c", "sleep 0.3"}, 2, RandomId(5));
  ASSERT_TRUE(pids.ok()) << pids.status().ToString();
  const Status s = ReapWorkers(*pids, milliseconds::max());
  EXPECT_TRUE(s.ok()) << s.ToString();
}

// waitpid(0) / kill(0) act on the whole process group and -1 on every
// process we may signal: such "pids" were passed on as they were. Run in a
// child in its own process group so that a regression cannot hit the test
// runner.
TEST(ReapWorkersTest, NonPositivePidsAreFailuresNotProcessGroups) {
  EXPECT_EXIT(
      {
        ::setpgid(0, 0);
        auto pids = SpawnLocalWorkers({"/bin/sh", "-c", "exit 7"}, 2, RandomId(6));
        if (!pids.ok() || pids->size() != 1) std::_Exit(10);
        const Status s = ReapWorkers({0, -1}, std::chrono::seconds(5));
        int status = 0;  // the real worker must still be ours to reap
        if (::waitpid(pids->front(), &status, 0) != pids->front()) std::_Exit(11);
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 7) std::_Exit(12);
        if (s.ok() || !Contains(s.message(), "rank 1 (pid 0) is not a process id") ||
            !Contains(s.message(), "rank 2 (pid -1) is not a process id")) {
          std::_Exit(13);
        }
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace tpserve
