// Bootstrap for NCCL: who am I (rank, world size, local GPU), and the hand-out
// of the 128-byte ncclUniqueId that every rank needs before
// NcclCommunicator::Create. Nothing else travels through these channels: NCCL
// is the only data transport.
//
// Single node (`tpserve serve --tp N`; rank 0 starts the others):
//   rank 0:   ncclGetUniqueId(&id);
//             SpawnLocalWorkers({"/proc/self/exe", args...}, N, id);
//   rank r>0: RankInfoFromEnv() and UniqueIdFromEnv() read what the spawner
//             put in the environment (TPSERVE_RANK, TPSERVE_WORLD_SIZE,
//             TPSERVE_LOCAL_RANK, TPSERVE_NCCL_ID).
//
// Several nodes (one process per GPU, started by mpirun or by a Kubernetes
// LeaderWorkerSet):
//   every rank: RankInfoFromEnv(); RendezvousAddressFromEnv() gives rank 0's
//               address (TPSERVE_RENDEZVOUS=host:port, or LWS_LEADER_ADDRESS
//               with TPSERVE_RENDEZVOUS_PORT or kDefaultRendezvousPort).
//   rank 0:     ncclGetUniqueId(&id);
//               ServeUniqueId(id, port, world_size - 1, deadline);
//   rank r>0:   FetchUniqueId(host, port, deadline);  // retries until rank 0 listens
//
// Rendezvous wire protocol (TCP, one short connection per fetching rank): the
// client sends the 8 bytes kRendezvousHello; the server answers with the same
// 8 bytes followed by the 128 id bytes and closes. Connections that do not
// greet correctly (port scanners, health probes), or whose client has already
// closed them (a fetcher that gave up and retries), are dropped and not
// counted.
// There is no authentication: whoever fetches the id can join the NCCL
// bootstrap, so the port must only be reachable inside the trusted cluster
// network. Every wait is bounded by the caller's deadline (poll() with
// timeouts; name resolution uses the system resolver's own timeouts).
//
// Thread-safety: all functions are reentrant; a UniqueIdServer is used by one
// thread at a time.
#pragma once

#include <nccl.h>
#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "comm/status.h"

namespace tpserve {

// A getenv-like lookup: returns nullptr when `name` is not set. Injected so
// that the environment can be faked in tests. An empty value counts as unset.
using EnvLookup = std::function<const char*(const char* name)>;

// The process environment (std::getenv).
EnvLookup ProcessEnv();

// ---------------------------------------------------------------------------
// Unique id <-> text

// 256 lowercase hex characters, byte 0 first.
std::string NcclUniqueIdToHex(const ncclUniqueId& id);

// Accepts upper- and lowercase hex. Errors say what was wrong: the length
// (expected 256 characters) or the first bad character and its position.
StatusOr<ncclUniqueId> NcclUniqueIdFromHex(std::string_view hex);

// ---------------------------------------------------------------------------
// Who am I

struct RankInfo {
  // Global rank, 0 <= rank < world_size.
  int rank = 0;
  // Number of ranks (= GPUs = processes) in the tensor-parallel group.
  int world_size = 1;
  // Index of this process on its node: the CUDA device it drives.
  int local_rank = 0;
  // Which launcher's variables were read: "tpserve", "mpirun" or "lws".
  std::string source;
  // Ranks this process must start itself on its node, as ranks rank+1 ..
  // rank+spawn_local with local ranks 1 .. spawn_local: a LeaderWorkerSet pod
  // runs one process for its TPSERVE_GPUS_PER_NODE GPUs (spawn_local =
  // gpus_per_node - 1); mpirun starts every rank itself (0).
  int spawn_local = 0;
};

// Reads the rank from the first of these sets of variables that is present
// (a set is present when any of its variables is set; a present set must be
// complete and consistent, there is no falling through to the next one):
//  1. tpserve's own: TPSERVE_RANK, TPSERVE_WORLD_SIZE (both required),
//     TPSERVE_LOCAL_RANK (optional, defaults to TPSERVE_RANK: single node).
//     SpawnLocalWorkers sets these; they also override a launcher's choice.
//  2. Open MPI's mpirun: OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE,
//     OMPI_COMM_WORLD_LOCAL_RANK (all required).
//  3. Kubernetes LeaderWorkerSet: LWS_WORKER_INDEX (pod index in the group, 0
//     = leader), LWS_GROUP_SIZE (pods in the group), and tpserve's
//     TPSERVE_GPUS_PER_NODE (GPUs = processes per pod, default 1). The pod's
//     first process gets rank = LWS_WORKER_INDEX * gpus_per_node and
//     local_rank 0; world_size = LWS_GROUP_SIZE * gpus_per_node. With several
//     GPUs per pod that process starts the pod's other ranks itself, with the
//     TPSERVE_* variables set (set 1 wins over set 3).
// NOT_FOUND when none is present (the caller may then run a single rank);
// INVALID_ARGUMENT naming the variable and its value when one is malformed,
// missing from a present set, or out of range.
StatusOr<RankInfo> RankInfoFromEnv(const EnvLookup& env = ProcessEnv());

// The variables SpawnLocalWorkers passes to its children.
inline constexpr const char* kEnvRank = "TPSERVE_RANK";
inline constexpr const char* kEnvWorldSize = "TPSERVE_WORLD_SIZE";
inline constexpr const char* kEnvLocalRank = "TPSERVE_LOCAL_RANK";
inline constexpr const char* kEnvNcclId = "TPSERVE_NCCL_ID";

// The unique id from TPSERVE_NCCL_ID (hex). NOT_FOUND when unset;
// INVALID_ARGUMENT (naming the variable) when it is not a valid id.
StatusOr<ncclUniqueId> UniqueIdFromEnv(const EnvLookup& env = ProcessEnv());

// ---------------------------------------------------------------------------
// Launch plan: what one process of a tensor-parallel group does at start.

struct LaunchPlan {
  enum class Role {
    kLeader,  // rank 0: serves clients, drives the batches
    kWorker,  // rank > 0: runs the worker loop
  };
  Role role = Role::kLeader;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;            // the CUDA device of this process
  std::vector<int> spawn_ranks;  // global ranks this process starts on its node (local 1, 2, ...)
  bool id_from_env = false;      // the id is in TPSERVE_NCCL_ID (a parent started us)
  bool fetch_id = false;         // fetch the id from rank 0's rendezvous
  int serve_id_clients = 0;      // rank 0: processes that will fetch the id over TCP
};

// The plan for a group of `tp` ranks, from RankInfoFromEnv()'s result:
//  - NOT_FOUND (no launcher): a single node, this process is rank 0 and
//    starts ranks 1..tp-1 itself (SpawnLocalWorkers).
//  - tpserve's variables: a worker a parent started (the id is in the
//    environment); spawns nothing.
//  - mpirun / LeaderWorkerSet: rank 0 leads and hands the id to the other
//    launcher-started processes over TCP (ServeUniqueId); every other one
//    fetches it (FetchUniqueId); each starts its node's extra ranks
//    (RankInfo::spawn_local).
// INVALID_ARGUMENT when the launcher's world size is not `tp`; other errors of
// `info` are returned as they are.
StatusOr<LaunchPlan> PlanLaunch(const StatusOr<RankInfo>& info, int tp);

// ---------------------------------------------------------------------------
// Single node: rank 0 starts ranks 1..world_size-1

// Starts world_size-1 processes with posix_spawn: argv[0] is the executable's
// path (e.g. "/proc/self/exe"; no PATH search) and argv the full argument
// vector. Each child's environment is this process's environment with
// TPSERVE_RANK=r, TPSERVE_WORLD_SIZE, TPSERVE_LOCAL_RANK=r and
// TPSERVE_NCCL_ID=<hex> replacing any inherited values; of this process's file
// descriptors they inherit only 0, 1 and 2. Returns the children's
// pids, element i being rank i+1; the caller owns them (waitpid, and SIGTERM
// at shutdown). If starting rank r fails, the ranks already started are sent
// SIGKILL and reaped before the error (naming the executable and rank) is
// returned. world_size == 1 starts nothing.
StatusOr<std::vector<pid_t>> SpawnLocalWorkers(const std::vector<std::string>& argv, int world_size,
                                               const ncclUniqueId& id);

// The general form: starts global ranks `ranks` (local ranks 1, 2, ... in
// that order) of a world of world_size, with the same environment rules.
StatusOr<std::vector<pid_t>> SpawnWorkers(const std::vector<std::string>& argv, int world_size,
                                          const std::vector<int>& ranks, const ncclUniqueId& id);

// Waits until every pid in `pids` has exited or `timeout` has passed, then
// sends SIGKILL to those left and reaps them. INTERNAL naming each worker
// (as rank i+1 of pids[i]) that exited non-zero, died of a signal or had to
// be killed; OK when all exited 0. Unknown or already reaped pids, and pids
// <= 0 (never waited for or signalled), count as failures.
Status ReapWorkers(const std::vector<pid_t>& pids, std::chrono::milliseconds timeout);

// ---------------------------------------------------------------------------
// Several nodes: a TCP rendezvous that only hands out the unique id

inline constexpr char kRendezvousHello[8] = {'T', 'P', 'S', 'R', 'D', 'V', '1', '\n'};
inline constexpr uint16_t kDefaultRendezvousPort = 29533;

struct RendezvousAddress {
  std::string host;  // name or address, without brackets
  uint16_t port = 0;
};

// "host:port", "[v6-address]:port"; the port must be 1..65535.
StatusOr<RendezvousAddress> ParseHostPort(std::string_view text);

// TPSERVE_RENDEZVOUS=host:port if set; else LWS_LEADER_ADDRESS with the port
// from TPSERVE_RENDEZVOUS_PORT (default kDefaultRendezvousPort). NOT_FOUND
// when neither is set; INVALID_ARGUMENT naming the variable when malformed.
StatusOr<RendezvousAddress> RendezvousAddressFromEnv(const EnvLookup& env = ProcessEnv());

// Rank 0's side. Listen() binds and listens at once (port 0: the kernel picks
// a free port, see port()), so that fetchers that connect before Serve() wait
// in the backlog instead of being refused. Listens on all addresses (IPv6
// dual-stack where available, else IPv4). Move-only; closes its socket.
class UniqueIdServer {
 public:
  static StatusOr<UniqueIdServer> Listen(uint16_t port);

  UniqueIdServer(UniqueIdServer&& other) noexcept;
  UniqueIdServer& operator=(UniqueIdServer&& other) noexcept;
  UniqueIdServer(const UniqueIdServer&) = delete;
  UniqueIdServer& operator=(const UniqueIdServer&) = delete;
  ~UniqueIdServer();

  uint16_t port() const { return port_; }

  // Hands `id` to `expected_clients` well-behaved clients, one at a time, then
  // returns OK. DEADLINE_EXCEEDED (saying how many were served) when the
  // deadline passes first. A client gets at most 2 s (and never past the
  // deadline) to greet and read; a slow or silent one is dropped.
  Status Serve(const ncclUniqueId& id, int expected_clients,
               std::chrono::steady_clock::time_point deadline);

 private:
  UniqueIdServer(int fd, uint16_t port) : fd_(fd), port_(port) {}
  int fd_ = -1;
  uint16_t port_ = 0;
};

// Listen(port) + Serve(...).
Status ServeUniqueId(const ncclUniqueId& id, uint16_t port, int expected_clients,
                     std::chrono::steady_clock::time_point deadline);

// The other ranks' side: connects to host:port and reads the id. Retries
// (name resolution, refused or failed connections, truncated replies) every
// 100 ms until the deadline; then DEADLINE_EXCEEDED with the last error.
StatusOr<ncclUniqueId> FetchUniqueId(const std::string& host, uint16_t port,
                                     std::chrono::steady_clock::time_point deadline);

}  // namespace tpserve
