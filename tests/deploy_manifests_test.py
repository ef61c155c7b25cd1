"""Static checks of deploy/: Kubernetes manifests, Dockerfile, overlap configs.

Parses and checks required fields only; nothing is built or applied (CI has no
container engine or cluster). DEPLOY_DIR points at deploy/ (default: ../deploy
relative to this file). Needs PyYAML (Debian: python3-yaml).
"""

import fnmatch
import glob
import os
import re
import shlex
import unittest

import yaml

DEPLOY_DIR = os.environ.get(
    "DEPLOY_DIR", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "deploy"))
REPO_DIR = os.path.join(DEPLOY_DIR, "..")
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


def repo_text(*parts):
    """A file of the repository (DEPLOY_DIR/..), or None where it is absent."""
    path = os.path.join(REPO_DIR, *parts)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return f.read()


def statement_flags(text):
    """{flag: choices or None} of the add_option/add_flag calls in C++ `text`."""
    flags = {}
    for m in re.finditer(r'add_(?:option|flag)\(\s*"(--[a-z0-9-]+)"', text):
        stmt = text[m.start():text.find(";\n", m.start())]  # help texts may hold a ";"
        member = re.search(r"IsMember\(\{([^}]*)\}\)", stmt)
        flags[m.group(1)] = set(re.findall(r'"([^"]*)"', member.group(1))) if member else None
    return flags


def serve_flags():
    """The flags of `tpserve serve`, read from server/cli_serve.cc (None without
    the source): its own add_option/add_flag calls and those of the Add*Flag(s)
    helpers it calls, and of the helpers those call in turn (server/cli_serve_flags.cc,
    server/cli_gemm_algo.h)."""
    text = repo_text("server", "cli_serve.cc")
    if text is None:
        return None
    start = text.find('"serve",')
    end = text.find('"worker",', start)
    block = text[start:end]
    flags = statement_flags(block)
    sources = []
    for path in glob.glob(os.path.join(REPO_DIR, "*", "*.h")) + \
            glob.glob(os.path.join(REPO_DIR, "*", "*.cc")):
        with open(path, encoding="utf-8") as f:
            sources.append(f.read())
    pending = set(re.findall(r"\b(Add\w*Flags?)\(cmd\b", block))
    seen = set()
    while pending:
        helper = pending.pop()
        seen.add(helper)
        for src in sources:
            m = re.search(r"void %s\([^;{]*\)\s*\{" % helper, src)  # the definition
            if m:
                body = src[m.start():src.find("\n}", m.start())]
                flags.update(statement_flags(body))
                pending.update(set(re.findall(r"\b(Add\w*Flags?)\(cmd\b", body)) - seen)
                break
    return flags


def flag_names(args):
    """The --flags in an argument list (`--flag=v` or `--flag v`)."""
    return [a.split("=", 1)[0] for a in args if a.startswith("--")]


def pod_templates():
    """(label, pod template, labels the controller adds) of every workload."""
    out = []
    for d in by_kind("Deployment"):
        out.append(("Deployment " + d["metadata"]["name"], d["spec"]["template"], {}))
    for d in by_kind("LeaderWorkerSet"):
        tmpl = d["spec"]["leaderWorkerTemplate"]
        name = d["metadata"]["name"]
        for key, index in (("leaderTemplate", "0"), ("workerTemplate", "1")):
            if key in tmpl:
                injected = {"leaderworkerset.sigs.k8s.io/name": name,
                            "leaderworkerset.sigs.k8s.io/worker-index": index}
                out.append(("%s %s" % (name, key), tmpl[key], injected))
    return out


def tpserve_containers():
    """(label, pod spec, container) of every container that runs the image's
    `tpserve serve` entrypoint."""
    out = []
    for label, tmpl, _ in pod_templates():
        for c in tmpl["spec"]["containers"]:
            if "command" not in c:
                out.append(("%s/%s" % (label, c["name"]), tmpl["spec"], c))
    return out


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

    def test_no_service_takes_the_name_of_lws_own_headless_service(self):
        # LWS creates a headless Service named after the LeaderWorkerSet (pod DNS names,
        # LWS_LEADER_ADDRESS) and skips it when one of that name exists: ours must differ.
        name = self.lws["metadata"]["name"]
        for svc in by_kind("Service"):
            self.assertNotEqual(svc["metadata"]["name"], name)

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


# Field names of the Kubernetes objects used here (core/v1, apps/v1 as of
# Kubernetes 1.32; LeaderWorkerSet v1; Prometheus Operator ServiceMonitor v1).
# A misspelt or misplaced field is rejected by the API server (strict field
# validation) or, worse, silently dropped by older ones.
K8S_FIELDS = {
    "ObjectMeta": {"name", "namespace", "labels", "annotations", "generateName",
                   "finalizers", "ownerReferences"},
    "DeploymentSpec": {"replicas", "selector", "template", "strategy", "minReadySeconds",
                       "revisionHistoryLimit", "progressDeadlineSeconds", "paused"},
    "DeploymentStrategy": {"type", "rollingUpdate"},
    "LabelSelector": {"matchLabels", "matchExpressions"},
    "PodTemplateSpec": {"metadata", "spec"},
    "PodSpec": {"activeDeadlineSeconds", "affinity", "automountServiceAccountToken",
                "containers", "dnsConfig", "dnsPolicy", "enableServiceLinks",
                "ephemeralContainers", "hostAliases", "hostIPC", "hostNetwork", "hostPID",
                "hostUsers", "hostname", "imagePullSecrets", "initContainers", "nodeName",
                "nodeSelector", "os", "overhead", "preemptionPolicy", "priority",
                "priorityClassName", "readinessGates", "resourceClaims", "resources",
                "restartPolicy", "runtimeClassName", "schedulerName", "schedulingGates",
                "securityContext", "serviceAccount", "serviceAccountName",
                "setHostnameAsFQDN", "shareProcessNamespace", "subdomain",
                "terminationGracePeriodSeconds", "tolerations", "topologySpreadConstraints",
                "volumes"},
    "PodSecurityContext": {"appArmorProfile", "fsGroup", "fsGroupChangePolicy", "runAsGroup",
                           "runAsNonRoot", "runAsUser", "seLinuxChangePolicy",
                           "seLinuxOptions", "seccompProfile", "supplementalGroups",
                           "supplementalGroupsPolicy", "sysctls", "windowsOptions"},
    "Toleration": {"key", "operator", "value", "effect", "tolerationSeconds"},
    "Container": {"args", "command", "env", "envFrom", "image", "imagePullPolicy", "lifecycle",
                  "livenessProbe", "name", "ports", "readinessProbe", "resizePolicy",
                  "resources", "restartPolicy", "securityContext", "startupProbe", "stdin",
                  "stdinOnce", "terminationMessagePath", "terminationMessagePolicy", "tty",
                  "volumeDevices", "volumeMounts", "workingDir"},
    "ContainerPort": {"containerPort", "hostIP", "hostPort", "name", "protocol"},
    "EnvVar": {"name", "value", "valueFrom"},
    "ResourceRequirements": {"limits", "requests", "claims"},
    "Probe": {"exec", "failureThreshold", "grpc", "httpGet", "initialDelaySeconds",
              "periodSeconds", "successThreshold", "tcpSocket", "terminationGracePeriodSeconds",
              "timeoutSeconds"},
    "GRPCAction": {"port", "service"},
    "VolumeMount": {"name", "mountPath", "readOnly", "recursiveReadOnly", "subPath",
                    "subPathExpr", "mountPropagation"},
    "EmptyDirVolumeSource": {"medium", "sizeLimit"},
    "PersistentVolumeClaimVolumeSource": {"claimName", "readOnly"},
    "ConfigMapVolumeSource": {"name", "items", "defaultMode", "optional"},
    "ServiceSpec": {"allocateLoadBalancerNodePorts", "clusterIP", "clusterIPs", "externalIPs",
                    "externalName", "externalTrafficPolicy", "healthCheckNodePort",
                    "internalTrafficPolicy", "ipFamilies", "ipFamilyPolicy",
                    "loadBalancerClass", "loadBalancerIP", "loadBalancerSourceRanges", "ports",
                    "publishNotReadyAddresses", "selector", "sessionAffinity",
                    "sessionAffinityConfig", "trafficDistribution", "type"},
    "ServicePort": {"appProtocol", "name", "nodePort", "port", "protocol", "targetPort"},
    "LeaderWorkerSetSpec": {"replicas", "leaderWorkerTemplate", "rolloutStrategy",
                            "startupPolicy", "networkConfig"},
    "LeaderWorkerTemplate": {"leaderTemplate", "workerTemplate", "size", "restartPolicy",
                             "subGroupPolicy"},
    "ServiceMonitorSpec": {"endpoints", "selector", "namespaceSelector", "jobLabel",
                           "targetLabels", "podTargetLabels", "sampleLimit", "targetLimit",
                           "attachMetadata", "scrapeClass", "labelLimit", "labelNameLengthLimit",
                           "labelValueLengthLimit", "keepDroppedTargets", "selectorMechanism",
                           "scrapeProtocols", "fallbackScrapeProtocol"},
    "Endpoint": {"port", "targetPort", "path", "scheme", "params", "interval", "scrapeTimeout",
                 "tlsConfig", "bearerTokenFile", "bearerTokenSecret", "authorization",
                 "honorLabels", "honorTimestamps", "trackTimestampsStaleness", "basicAuth",
                 "oauth2", "metricRelabelings", "relabelings", "proxyUrl", "followRedirects",
                 "enableHttp2", "filterRunning"},
}
VOLUME_SOURCES = {"emptyDir": "EmptyDirVolumeSource",
                  "persistentVolumeClaim": "PersistentVolumeClaimVolumeSource",
                  "configMap": "ConfigMapVolumeSource", "secret": None, "hostPath": None,
                  "csi": None, "ephemeral": None, "nfs": None, "projected": None,
                  "downwardAPI": None, "image": None}
IANA_SVC_NAME = re.compile(r"^(?=.{1,15}$)(?!.*--)[a-z0-9]([a-z0-9-]*[a-z0-9])?$")
QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")


def is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


class ManifestSchema(unittest.TestCase):
    """Field names and value types of every object, checked against
    K8S_FIELDS (a stand-in for `kubectl apply --dry-run=server`)."""

    def fields(self, obj, kind, where):
        self.assertIsInstance(obj, dict, where)
        unknown = sorted(set(obj) - K8S_FIELDS[kind])
        self.assertEqual(unknown, [], "%s: not fields of %s" % (where, kind))

    def string_map(self, m, where):
        for k, v in (m or {}).items():
            self.assertIsInstance(v, str, "%s: %s must be a string, got %r" % (where, k, v))

    def meta(self, meta, where):
        self.fields(meta, "ObjectMeta", where + ".metadata")
        self.string_map(meta.get("labels"), where + ".metadata.labels")
        self.string_map(meta.get("annotations"), where + ".metadata.annotations")

    def probe(self, p, where):
        self.fields(p, "Probe", where)
        for k in ("periodSeconds", "timeoutSeconds", "failureThreshold", "successThreshold",
                  "initialDelaySeconds"):
            if k in p:
                self.assertTrue(is_int(p[k]) and p[k] >= 0, "%s.%s" % (where, k))
        if "grpc" in p:
            self.fields(p["grpc"], "GRPCAction", where + ".grpc")
            # GRPCAction.port is an int32: unlike httpGet, no named ports.
            self.assertTrue(is_int(p["grpc"]["port"]), where + ".grpc.port must be a number")

    def container(self, c, where):
        self.fields(c, "Container", where)
        self.assertIsInstance(c["name"], str, where)
        self.assertIsInstance(c["image"], str, where)
        self.assertIn(c.get("imagePullPolicy", "IfNotPresent"),
                      ("Always", "IfNotPresent", "Never"), where)
        for a in c.get("args", []) + c.get("command", []):
            self.assertIsInstance(a, str, "%s: args must be strings, got %r" % (where, a))
        for p in c.get("ports", []):
            self.fields(p, "ContainerPort", where + ".ports")
            self.assertTrue(is_int(p["containerPort"]) and 0 < p["containerPort"] < 65536, where)
            self.assertIn(p.get("protocol", "TCP"), ("TCP", "UDP", "SCTP"), where)
            if "name" in p:
                self.assertRegex(p["name"], IANA_SVC_NAME, where + ": port name")
        for e in c.get("env", []):
            self.fields(e, "EnvVar", where + ".env")
            if "value" in e:
                self.assertIsInstance(e["value"], str,
                                      "%s: env %s must be a string (quote it)" % (where, e["name"]))
        res = c.get("resources", {})
        self.fields(res, "ResourceRequirements", where + ".resources")
        for part in ("limits", "requests"):
            for k, v in res.get(part, {}).items():
                self.assertRegex(str(v), QUANTITY, "%s.resources.%s.%s" % (where, part, k))
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            if probe in c:
                self.probe(c[probe], "%s.%s" % (where, probe))
        for m in c.get("volumeMounts", []):
            self.fields(m, "VolumeMount", where + ".volumeMounts")

    def pod_template(self, tmpl, where):
        self.fields(tmpl, "PodTemplateSpec", where)
        self.meta(tmpl.get("metadata", {}), where)
        spec = tmpl["spec"]
        self.fields(spec, "PodSpec", where + ".spec")
        if "terminationGracePeriodSeconds" in spec:
            self.assertTrue(is_int(spec["terminationGracePeriodSeconds"]), where)
        self.fields(spec.get("securityContext", {}), "PodSecurityContext",
                    where + ".spec.securityContext")
        for t in spec.get("tolerations", []):
            self.fields(t, "Toleration", where + ".spec.tolerations")
            self.assertIn(t.get("operator", "Equal"), ("Exists", "Equal"), where)
            self.assertIn(t.get("effect", ""),
                          ("", "NoSchedule", "PreferNoSchedule", "NoExecute"), where)
        volumes = {}
        for v in spec.get("volumes", []):
            sources = [k for k in v if k != "name"]
            self.assertEqual(len(sources), 1, "%s: volume %s needs one source" % (where, v))
            self.assertIn(sources[0], VOLUME_SOURCES, where)
            if VOLUME_SOURCES[sources[0]]:
                self.fields(v[sources[0]], VOLUME_SOURCES[sources[0]],
                            "%s.volumes.%s" % (where, v["name"]))
            if sources[0] == "emptyDir":
                self.assertIn(v["emptyDir"].get("medium", ""), ("", "Memory"), where)
            volumes[v["name"]] = v
        for c in spec["containers"]:
            self.container(c, "%s/%s" % (where, c["name"]))
            for m in c.get("volumeMounts", []):
                self.assertIn(m["name"], volumes, "%s/%s: mount of an undeclared volume"
                              % (where, c["name"]))

    def test_objects(self):
        for path, doc in k8s_docs():
            where = "%s %s/%s" % (os.path.basename(path), doc["kind"], doc["metadata"]["name"])
            with self.subTest(object=where):
                self.meta(doc["metadata"], where)
                spec = doc["spec"]
                if doc["kind"] == "Deployment":
                    self.fields(spec, "DeploymentSpec", where + ".spec")
                    self.fields(spec["selector"], "LabelSelector", where + ".spec.selector")
                    self.fields(spec.get("strategy", {}), "DeploymentStrategy", where)
                    self.assertIn(spec.get("strategy", {}).get("type", "RollingUpdate"),
                                  ("Recreate", "RollingUpdate"), where)
                    self.pod_template(spec["template"], where + ".spec.template")
                elif doc["kind"] == "LeaderWorkerSet":
                    self.fields(spec, "LeaderWorkerSetSpec", where + ".spec")
                    self.assertIn(spec.get("startupPolicy", "LeaderCreated"),
                                  ("LeaderCreated", "LeaderReady"), where)
                    lwt = spec["leaderWorkerTemplate"]
                    self.fields(lwt, "LeaderWorkerTemplate", where + ".leaderWorkerTemplate")
                    self.assertTrue(is_int(lwt["size"]), where)
                    self.assertIn(lwt.get("restartPolicy", "RecreateGroupOnPodRestart"),
                                  ("RecreateGroupOnPodRestart", "None", "Default"), where)
                    for key in ("leaderTemplate", "workerTemplate"):
                        if key in lwt:
                            self.pod_template(lwt[key], "%s.%s" % (where, key))
                elif doc["kind"] == "Service":
                    self.fields(spec, "ServiceSpec", where + ".spec")
                    self.string_map(spec.get("selector"), where + ".spec.selector")
                    self.assertIn(spec.get("type", "ClusterIP"),
                                  ("ClusterIP", "NodePort", "LoadBalancer", "ExternalName"), where)
                    for p in spec["ports"]:
                        self.fields(p, "ServicePort", where + ".spec.ports")
                        self.assertTrue(is_int(p["port"]), where)
                        self.assertRegex(p["name"], IANA_SVC_NAME, where)
                elif doc["kind"] == "ServiceMonitor":
                    self.fields(spec, "ServiceMonitorSpec", where + ".spec")
                    self.fields(spec["selector"], "LabelSelector", where + ".spec.selector")
                    for e in spec["endpoints"]:
                        self.fields(e, "Endpoint", where + ".spec.endpoints")
                else:
                    self.fail("%s: kind %s is not checked here: add it" % (where, doc["kind"]))

    def test_service_target_ports_exist_on_the_selected_pods(self):
        for svc in by_kind("Service"):
            name = svc["metadata"]["name"]
            selector = svc["spec"]["selector"]
            pods = [(label, tmpl) for label, tmpl, injected in pod_templates()
                    if selector.items() <= dict(tmpl.get("metadata", {}).get("labels", {}),
                                                **injected).items()]
            with self.subTest(service=name):
                self.assertTrue(pods, "Service %s selects no pods" % name)
                for label, tmpl in pods:
                    ports = {p.get("name"): p["containerPort"]
                             for c in tmpl["spec"]["containers"] for p in c.get("ports", [])}
                    for p in svc["spec"]["ports"]:
                        target = p.get("targetPort", p["port"])
                        if isinstance(target, str):
                            self.assertIn(target, ports, "%s -> %s" % (name, label))
                        else:
                            self.assertIn(target, ports.values(), "%s -> %s" % (name, label))


class ServeArguments(unittest.TestCase):
    """Container args, the image's CMD and the README's `docker run` lines
    against the flags `tpserve serve` defines (server/cli_serve*.cc)."""

    def setUp(self):
        self.flags = serve_flags()
        if self.flags is None:
            self.skipTest("no server/cli_serve.cc")
        self.assertIn("--tp", self.flags, "could not read the serve flags")

    def check_args(self, args, where):
        for i, a in enumerate(args):
            if not a.startswith("--"):
                continue
            name = a.split("=", 1)[0]
            self.assertIn(name, self.flags, "%s: `tpserve serve` has no %s" % (where, name))
            choices = self.flags[name]
            if choices:
                value = a.split("=", 1)[1] if "=" in a else args[i + 1]
                self.assertIn(value, choices, "%s: %s" % (where, a))

    def test_container_args(self):
        containers = tpserve_containers()
        self.assertTrue(containers)
        for label, _, c in containers:
            with self.subTest(container=label):
                self.check_args(c.get("args", []), label)

    def test_image_cmd(self):
        with open(os.path.join(DEPLOY_DIR, "Dockerfile"), encoding="utf-8") as f:
            text = re.sub(r"\\\n", " ", f.read())
        cmd = [l for l in text.splitlines() if l.startswith("CMD ")]
        self.assertTrue(cmd)
        self.check_args(yaml.safe_load(cmd[-1][4:]), "Dockerfile CMD")

    def test_readme_docker_run(self):
        with open(os.path.join(DEPLOY_DIR, "README.md"), encoding="utf-8") as f:
            text = re.sub(r"\\\n", " ", f.read())
        runs = [shlex.split(l, comments=True) for l in text.splitlines()
                if l.startswith("docker run ")]
        self.assertTrue(runs, "no `docker run` line in deploy/README.md")
        for words in runs:
            image = [i for i, w in enumerate(words) if w.startswith("tpserve:")]
            self.assertTrue(image, words)
            self.check_args(words[image[0] + 1:], "README docker run")

    def test_ports_and_probes_match_the_flags(self):
        for label, _, c in tpserve_containers():
            args = c.get("args", [])
            ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
            with self.subTest(container=label):
                if "grpc" in ports:
                    grpc = int(arg_value(args, "--grpc-port") or GRPC_PORT)
                    self.assertEqual(ports["grpc"], grpc)
                    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
                        if probe in c:
                            self.assertEqual(c[probe]["grpc"]["port"], grpc, probe)
                if "metrics" in ports:
                    self.assertEqual(ports["metrics"],
                                     int(arg_value(args, "--metrics-port") or METRICS_PORT))

    def test_grace_period_covers_drain_and_teardown(self):
        # After --exit-timeout the binary allows itself kTeardownGraceS more
        # before exiting 1; the kubelet must not SIGKILL before that.
        src = repo_text("server", "cli_serve.cc") or ""
        m = re.search(r"kTeardownGraceS\s*=\s*(\d+)", src)
        teardown = int(m.group(1)) if m else 20
        for label, spec, c in tpserve_containers():
            exit_timeout = arg_value(c.get("args", []), "--exit-timeout")
            if exit_timeout is None:
                continue
            pre_stop = (((c.get("lifecycle") or {}).get("preStop") or {}).get("sleep")
                        or {}).get("seconds", 0)
            with self.subTest(container=label):
                self.assertGreaterEqual(spec["terminationGracePeriodSeconds"],
                                        pre_stop + float(exit_timeout) + teardown)

    def test_overlap_config_matches_tp(self):
        multi_node = {"%s/%s" % (l, c["name"]) for l, t, inj in pod_templates()
                      if inj for c in t["spec"]["containers"]}
        for label, _, c in tpserve_containers():
            path = arg_value(c.get("args", []), "--overlap-config")
            if not path or not path.startswith("/etc/tpserve/"):
                continue
            with self.subTest(container=label):
                docs = load_docs(os.path.join(DEPLOY_DIR, os.path.basename(path)))
                self.assertEqual(docs[0].get("tp"), int(arg_value(c["args"], "--tp")),
                                 "%s: config made for another --tp" % path)
                if label in multi_node:
                    # Copy-engine transfers use peer memory: one node only.
                    self.assertNotIn("copy_engine: true", yaml.safe_dump(docs[0]),
                                     "%s: copy_engine needs all ranks on one node" % path)

    def test_tpserve_env_vars_are_read_by_the_code(self):
        sources = ""
        for d in ("comm", "engine", "server"):
            for path in glob.glob(os.path.join(REPO_DIR, d, "*.cc")) + \
                    glob.glob(os.path.join(REPO_DIR, d, "*.h")):
                with open(path, encoding="utf-8") as f:
                    sources += f.read()
        if not sources:
            self.skipTest("no sources")
        for label, _, c in tpserve_containers():
            for name in env_map(c):
                if name.startswith("TPSERVE_"):
                    self.assertTrue('"%s"' % name in sources,
                                    "%s: %s is read nowhere in comm/, engine/, server/"
                                    % (label, name))


def dockerignored(path, patterns):
    """Whether the build context drops `path` (relative to the context root):
    Docker's rules, simplified: the last matching pattern wins, `!` keeps, a
    pattern matching a directory drops all below it."""
    parts = path.split("/")
    ignored = False
    for pat in patterns:
        keep = pat.startswith("!")
        pat = pat.lstrip("!").strip("/")
        alts = [pat] + ([pat[3:]] if pat.startswith("**/") else [])
        for i in range(1, len(parts) + 1):
            if any(fnmatch.fnmatchcase("/".join(parts[:i]), a) for a in alts):
                ignored = not keep
                break
    return ignored


class DockerBuild(unittest.TestCase):
    """The Dockerfile against the build context (the repository root, as the
    README's `docker build -f deploy/Dockerfile ... .` gives it) and CMake."""

    def setUp(self):
        with open(os.path.join(DEPLOY_DIR, "Dockerfile"), encoding="utf-8") as f:
            self.text = re.sub(r"\\\n", " ", f.read())
        self.lines = [l.strip() for l in self.text.splitlines()
                      if l.strip() and not l.strip().startswith("#")]
        ignore = os.path.join(DEPLOY_DIR, "Dockerfile.dockerignore")
        self.patterns = []
        if os.path.exists(ignore):
            with open(ignore, encoding="utf-8") as f:
                self.patterns = [l.strip() for l in f
                                 if l.strip() and not l.strip().startswith("#")]
        self.cmake = repo_text("CMakeLists.txt")
        if self.cmake is None:
            self.skipTest("no CMakeLists.txt beside deploy/")

    def arg_default(self, name):
        m = re.search(r"^ARG %s=(\S+)" % name, self.text, re.M)
        return m.group(1) if m else None

    def test_copy_sources_exist_and_are_not_ignored(self):
        copies = [l.split()[1:] for l in self.lines if l.split()[0].upper() == "COPY"]
        checked = 0
        for words in copies:
            if any(w.startswith("--from") for w in words):
                continue
            for src in [w for w in words if not w.startswith("--")][:-1]:
                matches = glob.glob(os.path.join(REPO_DIR, src))
                self.assertTrue(matches, "COPY %s: nothing in the build context" % src)
                for m in matches:
                    rel = os.path.relpath(m, REPO_DIR).replace(os.sep, "/")
                    if rel != ".":
                        self.assertFalse(dockerignored(rel, self.patterns),
                                         "COPY %s: excluded by Dockerfile.dockerignore" % rel)
                checked += 1
        self.assertGreater(checked, 0)

    def test_build_inputs_are_in_the_context(self):
        needed = ["CMakeLists.txt", "cmake"]
        needed += re.findall(r"^add_subdirectory\((\w+)\)", self.cmake, re.M)
        for path in needed:
            self.assertTrue(os.path.exists(os.path.join(REPO_DIR, path)), path)
            self.assertFalse(dockerignored(path, self.patterns),
                             "%s is needed by the build but Dockerfile.dockerignore drops it"
                             % path)
        for path in (".git", "build", "build-asan", ".gpu"):
            self.assertTrue(dockerignored(path, self.patterns), path + " reaches the context")

    def test_cmake_options_and_target_exist(self):
        runs = " ".join(l for l in self.lines if l.split()[0].upper() == "RUN")
        options = set(re.findall(r"^option\((\w+)", self.cmake, re.M))
        for name in re.findall(r"-D(TPSERVE_\w+)=", runs):
            self.assertIn(name, options, "-D%s is not an option of CMakeLists.txt" % name)
        m = re.search(r"--target\s+(\S+)", runs)
        self.assertIsNotNone(m)
        target = m.group(1)
        if target.startswith("${"):
            target = self.arg_default(target.strip("${}"))
        if target != "all":
            defined = ""
            for path in glob.glob(os.path.join(REPO_DIR, "*", "CMakeLists.txt")):
                with open(path, encoding="utf-8") as f:
                    defined += f.read()
            self.assertRegex(defined, r"add_executable\(%s\s" % re.escape(target))

    def test_cuda_image_ships_nccl_2_28(self):
        # The nvidia/cuda 13.0.0 images ship NCCL 2.27.7, which lacks
        # NCCL_CTA_POLICY_ZERO (NCCL 2.28) that comm/ uses; 13.0.1 and later
        # ship 2.28.
        src = repo_text("comm", "nccl_communicator.cc") or ""
        if "NCCL_CTA_POLICY_ZERO" not in src:
            self.skipTest("comm/ does not need NCCL 2.28")
        version = self.arg_default("CUDA_VERSION")
        self.assertIsNotNone(version, "no ARG CUDA_VERSION default")
        self.assertGreaterEqual(tuple(int(x) for x in version.split(".")), (13, 0, 1),
                                "CUDA_VERSION=%s: its images ship NCCL < 2.28" % version)
        self.assertIn("NCCL_VERSION_CODE", self.text, "no NCCL version check in the build stage")

    def test_nvls_off_in_the_image(self):
        env = " ".join(l for l in self.lines if l.split()[0].upper() == "ENV")
        self.assertIn("NCCL_NVLS_ENABLE=0", env)


if __name__ == "__main__":
    unittest.main()
