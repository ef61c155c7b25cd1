"""Static checks of deploy/: Kubernetes manifests, Dockerfile, overlap configs.

Parses and checks required fields only; nothing is built or applied (CI has no
container engine or cluster). DEPLOY_DIR points at deploy/ (default: ../deploy
relative to this file). Needs PyYAML (Debian: python3-yaml).
"""

import glob
import os
import re
import shlex
import unittest

import yaml

DEPLOY_DIR = os.environ.get(
    "DEPLOY_DIR", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "deploy"))
GRPC_PORT = 8001
METRICS_PORT = 8002


def load_docs(path):
    with open(path, encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def k8s_docs():
    docs = []
    for path in sorted(glob.glob(os.path.join(DEPLOY_DIR, "k8s", "*.yaml"))):
        docs.extend((path, d) for d in load_docs(path))
    return docs


def by_kind(kind):
    return [d for _, d in k8s_docs() if d.get("kind") == kind]


def arg_value(args, flag):
    """The value of --flag in a container's args (`--flag=v` or `--flag v`)."""
    for i, a in enumerate(args):
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
        if a == flag and i + 1 < len(args):
            return args[i + 1]
    return None


def env_map(container):
    return {e["name"]: e.get("value") for e in container.get("env", [])}


class ManifestsParse(unittest.TestCase):
    def test_every_document_parses_and_has_kind(self):
        files = glob.glob(os.path.join(DEPLOY_DIR, "k8s", "*.yaml"))
        self.assertTrue(files, "no deploy/k8s/*.yaml")
        for path, doc in k8s_docs():
            with self.subTest(path=os.path.basename(path), kind=doc.get("kind")):
                self.assertIsInstance(doc, dict)
                for key in ("apiVersion", "kind", "metadata"):
                    self.assertIn(key, doc)
                self.assertTrue(doc["metadata"].get("name"))


class CheckPodSpec:
    """Checks shared by the Deployment and the LWS leader."""

    def check_serving_pod(self, spec, label):
        containers = spec["containers"]
        self.assertEqual(len(containers), 1, label)
        c = containers[0]
        ports = {p["containerPort"]: p.get("name") for p in c["ports"]}
        self.assertEqual(ports.get(GRPC_PORT), "grpc", label)
        self.assertEqual(ports.get(METRICS_PORT), "metrics", label)
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            with self.subTest(label=label, probe=probe):
                self.assertIn(probe, c)
                self.assertIn("grpc", c[probe], "native gRPC probe expected")
                self.assertEqual(c[probe]["grpc"]["port"], GRPC_PORT)
        start = c["startupProbe"]
        budget = start.get("periodSeconds", 10) * start.get("failureThreshold", 3)
        self.assertGreaterEqual(budget, 20 * 60, label + ": startup budget < 20 min")
        args = c["args"]
        self.assertEqual(arg_value(args, "--host"), "0.0.0.0", label)
        self.assertEqual(arg_value(args, "--metrics-host"), "0.0.0.0", label)
        exit_timeout = arg_value(args, "--exit-timeout")
        self.assertIsNotNone(exit_timeout, label + ": no --exit-timeout")
        self.assertGreater(spec["terminationGracePeriodSeconds"], float(exit_timeout), label)
        limits = c["resources"]["limits"]
        self.assertGreaterEqual(int(limits["nvidia.com/gpu"]), 1, label)
        self.assertEqual(env_map(c).get("NCCL_NVLS_ENABLE"), "0", label)
        # A pod that sees no GPUs must fail, not serve on the CPU engine.
        self.assertEqual(arg_value(args, "--backend"), "cuda", label)
        shm = [m for m in c.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
        self.assertEqual(len(shm), 1, label + ": no /dev/shm mount")
        vols = {v["name"]: v for v in spec["volumes"]}
        self.assertEqual(vols[shm[0]["name"]]["emptyDir"]["medium"], "Memory", label)
        return c


class SingleNode(unittest.TestCase, CheckPodSpec):
    def setUp(self):
        deployments = by_kind("Deployment")
        self.assertEqual(len(deployments), 1)
        self.dep = deployments[0]

    def test_deployment(self):
        self.assertEqual(self.dep["apiVersion"], "apps/v1")
        self.assertEqual(self.dep["spec"]["replicas"], 1)
        spec = self.dep["spec"]["template"]["spec"]
        c = self.check_serving_pod(spec, "Deployment")
        gpus = int(c["resources"]["limits"]["nvidia.com/gpu"])
        self.assertEqual(int(arg_value(c["args"], "--tp")), gpus, "--tp must equal the GPU limit")
        selector = self.dep["spec"]["selector"]["matchLabels"]
        labels = self.dep["spec"]["template"]["metadata"]["labels"]
        self.assertTrue(selector.items() <= labels.items())

    def test_service_and_servicemonitor(self):
        labels = self.dep["spec"]["template"]["metadata"]["labels"]
        services = [s for s in by_kind("Service")
                    if s["spec"]["selector"].items() <= labels.items()]
        self.assertEqual(len(services), 1, "one Service selecting the Deployment's pods")
        svc = services[0]
        ports = {p["name"]: p["port"] for p in svc["spec"]["ports"]}
        self.assertEqual(ports, {"grpc": GRPC_PORT, "metrics": METRICS_PORT})

        monitors = by_kind("ServiceMonitor")
        self.assertEqual(len(monitors), 1)
        sm = monitors[0]
        self.assertEqual(sm["apiVersion"], "monitoring.coreos.com/v1")
        self.assertTrue(sm["spec"]["selector"]["matchLabels"].items()
                        <= svc["metadata"]["labels"].items(),
                        "ServiceMonitor does not select the Service")
        endpoints = sm["spec"]["endpoints"]
        self.assertEqual(endpoints[0]["port"], "metrics")
        self.assertEqual(endpoints[0].get("path", "/metrics"), "/metrics")


class MultiNodeLws(unittest.TestCase, CheckPodSpec):
    def setUp(self):
        sets = by_kind("LeaderWorkerSet")
        self.assertEqual(len(sets), 1)
        self.lws = sets[0]
        self.tmpl = self.lws["spec"]["leaderWorkerTemplate"]

    def test_api_and_size(self):
        self.assertEqual(self.lws["apiVersion"], "leaderworkerset.x-k8s.io/v1")
        self.assertGreaterEqual(self.tmpl["size"], 2)

    def test_templates_and_rendezvous_env(self):
        gpus_per_node = None
        for name in ("leaderTemplate", "workerTemplate"):
            with self.subTest(template=name):
                self.assertIn(name, self.tmpl)
                c = self.tmpl[name]["spec"]["containers"][0]
                env = env_map(c)
                self.assertEqual(env.get("TPSERVE_RENDEZVOUS_PORT"), "29533")
                self.assertIn("TPSERVE_GPUS_PER_NODE", env)
                self.assertEqual(env.get("NCCL_NVLS_ENABLE"), "0")
                self.assertEqual(int(env["TPSERVE_GPUS_PER_NODE"]),
                                 int(c["resources"]["limits"]["nvidia.com/gpu"]))
                gpus_per_node = int(env["TPSERVE_GPUS_PER_NODE"])
                # LWS injects these; setting them would fight the controller.
                for injected in ("LWS_WORKER_INDEX", "LWS_GROUP_SIZE", "LWS_LEADER_ADDRESS"):
                    self.assertNotIn(injected, env)
                self.assertEqual(int(arg_value(c["args"], "--tp")),
                                 self.tmpl["size"] * gpus_per_node)

    def test_workers_take_the_leaders_engine_flags(self):
        # Workers size their buffers and build their layers from their own
        # flags: every flag but the leader's serving ones must match.
        serving_only = {"--model-name", "--host", "--grpc-port", "--metrics-host",
                        "--metrics-port"}

        def flags(template):
            args = self.tmpl[template]["spec"]["containers"][0]["args"]
            out = {}
            for a in args:
                self.assertTrue(a.startswith("--") and "=" in a,
                                "%s: write flags as --flag=value, got %r" % (template, a))
                name, value = a.split("=", 1)
                out[name] = value
            return out
        leader, worker = flags("leaderTemplate"), flags("workerTemplate")
        self.assertEqual({k: v for k, v in leader.items() if k not in serving_only}, worker)
        self.assertEqual(worker.get("--backend"), "cuda")

    def test_probes_on_leader_only(self):
        leader = self.check_serving_pod(self.tmpl["leaderTemplate"]["spec"], "leader")
        self.assertIn(29533, [p["containerPort"] for p in leader["ports"]])
        worker = self.tmpl["workerTemplate"]["spec"]["containers"][0]
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            self.assertNotIn(probe, worker)


class Dockerfile(unittest.TestCase):
    def setUp(self):
        with open(os.path.join(DEPLOY_DIR, "Dockerfile"), encoding="utf-8") as f:
            text = f.read()
        # Join continuation lines, drop comments.
        text = re.sub(r"\\\n", " ", text)
        self.lines = [l.strip() for l in text.splitlines()
                      if l.strip() and not l.strip().startswith("#")]

    def instr(self, name):
        return [l.split(None, 1)[1] if " " in l else "" for l in self.lines
                if l.split(None, 1)[0].upper() == name]

    def test_two_stages(self):
        froms = self.instr("FROM")
        self.assertEqual(len(froms), 2, froms)
        self.assertIn("devel", froms[0])
        self.assertIn("runtime", froms[1])
        self.assertIn("--from=build", " ".join(self.instr("COPY")))

    def test_non_root_user(self):
        users = self.instr("USER")
        self.assertTrue(users)
        user = users[-1].split(":")[0]
        self.assertNotIn(user, ("root", "0"))

    def test_expose_and_entrypoint(self):
        exposed = {p.split("/")[0] for e in self.instr("EXPOSE") for p in e.split()}
        self.assertTrue({"8001", "8002"} <= exposed, exposed)
        entry = self.instr("ENTRYPOINT")
        self.assertEqual(len(entry), 1)
        self.assertEqual(yaml.safe_load(entry[0])[:2], ["tpserve", "serve"])
        cmd = yaml.safe_load(self.instr("CMD")[-1])
        self.assertEqual(arg_value(cmd, "--host"), "0.0.0.0")
        self.assertEqual(arg_value(cmd, "--metrics-host"), "0.0.0.0")

    def test_build_matches_bootstrap(self):
        bootstrap = os.path.join(DEPLOY_DIR, "..", ".ci", "bootstrap")
        if not os.path.exists(bootstrap):
            self.skipTest("no .ci/bootstrap")
        with open(bootstrap, encoding="utf-8") as f:
            m = re.search(r"packages=\((.*?)\)", f.read(), re.S)
        wanted = set(shlex.split(m.group(1), comments=True))
        # Not needed to build: formatting, the Python test clients, and the
        # clang/libFuzzer toolchain of the fuzz tests.
        wanted -= {"clang-format", "python3", "python3-grpcio", "python3-protobuf",
                   "python3-yaml", "clang", "libclang-rt-14-dev", "openssl"}
        build_runs = " ".join(self.instr("RUN"))
        missing = sorted(p for p in wanted if p not in build_runs.split())
        self.assertEqual(missing, [], "packages .ci/bootstrap installs but the Dockerfile does not")
        self.assertIn("CMAKE_CUDA_ARCHITECTURES=90a", build_runs)
        self.assertIn("CMAKE_BUILD_TYPE=Release", build_runs)


class OverlapConfigs(unittest.TestCase):
    def test_overlap_configs_are_valid_yaml_version_1(self):
        files = sorted(glob.glob(os.path.join(DEPLOY_DIR, "overlap-*.yaml")))
        self.assertTrue(files, "no deploy/overlap-*.yaml")
        for path in files:
            with self.subTest(path=os.path.basename(path)):
                docs = load_docs(path)
                self.assertEqual(len(docs), 1)
                self.assertEqual(docs[0].get("version"), 1)
                tp = re.search(r"-tp(\d+)\.yaml$", path)
                if tp and "tp" in docs[0]:
                    self.assertEqual(docs[0]["tp"], int(tp.group(1)))

    def test_manifests_reference_existing_overlap_configs(self):
        names = {os.path.basename(p) for p in glob.glob(os.path.join(DEPLOY_DIR, "overlap-*.yaml"))}
        checked = 0
        for path in glob.glob(os.path.join(DEPLOY_DIR, "k8s", "*.yaml")):
            with open(path, encoding="utf-8") as f:
                for ref in re.findall(r"/etc/tpserve/(overlap-[\w.-]+\.yaml)", f.read()):
                    self.assertIn(ref, names, path)
                    checked += 1
        self.assertGreater(checked, 0, "no manifest references an overlap config")


if __name__ == "__main__":
    unittest.main()
