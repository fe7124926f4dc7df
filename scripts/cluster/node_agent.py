"""A minimal kubelet for the test cluster: runs the pods bound to its Node as local processes.

Run as root (it makes network namespaces). What it does, and what it deliberately does not:

- Registers a Node that advertises cpu, memory, pods and `nvidia.com/gpu` capacity (so GPU pods are
  scheduled), with a Ready condition and the bridge address as its InternalIP.
- Gives each bound pod its own network namespace, as a CNI plugin would: `ip netns`, a veth pair into a
  bridge it creates, and an address from a private /24 that only these namespaces use. The host side of
  the bridge holds .1, so the host (and the apiserver, via Endpoints) reaches pods at their IPs.
- Runs the first container's command + args as a process in that namespace (images are ignored; the
  command must exist on this machine, with this interpreter's bin directory first on PATH; an image
  named in --image-path IMAGE=DIR gets DIR first on PATH, so a test can give one pool a stand-in
  command while the others run the real one). ConfigMap
  and Secret volumes are written to a per-pod folder, and each volume's mountPath is rewritten to that
  folder in the command, args and env values. `fieldRef` env (metadata.name, metadata.namespace,
  status.podIP, spec.nodeName, spec.serviceAccountName) is filled in.
- Gives the process its ServiceAccount's token (TokenRequest) as a kubeconfig in KUBECONFIG, in place of
  the in-cluster mount a kubelet would make.
- Reports readiness from the readiness probe (httpGet or tcpSocket; the probe period is capped at
  --max-probe-period seconds to keep tests fast), which lets the endpoints controller fill Endpoints.
  A process that exits is restarted (restartPolicy Always) as a kubelet does: the container reports
  `lastState.terminated` (exit code, reason, times and the termination message: the file at
  terminationMessagePath, or with FallbackToLogsOnError the log's tail), waits in CrashLoopBackOff
  for a back-off that doubles from --backoff-base up to --backoff-max seconds (the kubelet's 10 s and
  300 s, shortened for tests; it is reset after 60 s of running), then restarts with restartCount + 1.
  The back-off never blocks the agent's loop. The process finds its terminationMessagePath through
  the env value that names it (rewritten like a mount path, since there is no mount namespace).
- On deletion: runs the preStop hook (httpGet or exec), sends SIGTERM, waits out the grace period,
  sends SIGKILL, removes the namespace and finally deletes the Pod object (as a kubelet does).
- hostPath and persistentVolumeClaim volumes (a PVC bound to a hostPath PersistentVolume) are bind
  mounts at their mountPath in the pod's own mount namespace (read-only where the mount says so).
- Not done: liveness-probe restarts, init/sidecar containers, resource limits, images, volumes other
  than configMap/secret/emptyDir/hostPath/persistentVolumeClaim.
"""
from __future__ import annotations

import argparse
import base64
import datetime as dt
import json
import logging
import os
import re
import shlex
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import yaml
from kubernetes import client, config
from kubernetes.client.rest import ApiException

log = logging.getLogger("node-agent")
import urllib3  # noqa: E402
urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip()}")
    return r


class PodRunner:
    def __init__(self, agent: "Agent", pod: client.V1Pod, index: int):
        self.agent = agent
        self.uid = pod.metadata.uid
        self.ns = pod.metadata.namespace
        self.name = pod.metadata.name
        self.pod = pod
        self.index = index
        self.ip = f"{agent.subnet}.{index}"
        self.netns = f"tdm{agent.subnet.split('.')[-1]}p{index}"
        self.veth_host = f"tv{agent.subnet.split('.')[-1]}h{index}"
        self.veth_pod = f"tv{agent.subnet.split('.')[-1]}c{index}"
        self.dir = agent.workdir / f"{self.ns}_{self.name}_{self.uid[:8]}"
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.ready = False
        self.started_at = now()
        self.last_probe = 0.0
        self.terminating = False
        self.done = False
        self.lock = threading.Lock()
        self.last_status: str | None = None
        self.last_terminated: dict | None = None
        self.next_start: float | None = None    # set while waiting out a crash back-off
        self.backoff = 0.0
        self.launched_at = 0.0

    # ---- setup --------------------------------------------------------------------------------
    def setup_network(self) -> None:
        a = self.agent
        sh("ip", "netns", "add", self.netns)
        sh("ip", "link", "add", self.veth_host, "type", "veth", "peer", "name", self.veth_pod)
        sh("ip", "link", "set", self.veth_pod, "netns", self.netns)
        sh("ip", "link", "set", self.veth_host, "master", a.bridge)
        sh("ip", "link", "set", self.veth_host, "up")
        ex = ("ip", "netns", "exec", self.netns)
        sh(*ex, "ip", "addr", "add", f"{self.ip}/24", "dev", self.veth_pod)
        sh(*ex, "ip", "link", "set", self.veth_pod, "up")
        sh(*ex, "ip", "link", "set", "lo", "up")
        sh(*ex, "ip", "route", "add", "default", "via", a.host_ip)

    def teardown_network(self) -> None:
        sh("ip", "netns", "delete", self.netns, check=False)
        sh("ip", "link", "delete", self.veth_host, check=False)

    def _pv_path(self, claim: str) -> str:
        """The host directory behind a PersistentVolumeClaim (bound to a hostPath PersistentVolume)."""
        pvc = self.agent.core.read_namespaced_persistent_volume_claim(claim, self.ns)
        if pvc.status is None or pvc.status.phase != "Bound" or not pvc.spec.volume_name:
            raise RuntimeError(f"PersistentVolumeClaim {self.ns}/{claim} is not bound yet")
        pv = self.agent.core.read_persistent_volume(pvc.spec.volume_name)
        if pv.spec.host_path is None:
            raise RuntimeError(f"PersistentVolume {pv.metadata.name}: only hostPath volumes are supported")
        return pv.spec.host_path.path

    def _volumes(self) -> dict[str, str]:
        """Write configMap/secret/emptyDir volumes to disk; return {mountPath: local dir}. hostPath and
        persistentVolumeClaim volumes become bind mounts in the pod's own mount namespace (self.binds),
        so the process reads them at their mountPath, as in a container."""
        spec = self.pod.spec
        c = spec.containers[0]
        local: dict[str, str] = {}
        self.binds: list[tuple[str, str, bool]] = []
        vols = {v.name: v for v in (spec.volumes or [])}
        for m in c.volume_mounts or []:
            v = vols.get(m.name)
            if v is None:
                continue
            if v.host_path is not None or v.persistent_volume_claim is not None:
                src = v.host_path.path if v.host_path is not None else self._pv_path(
                    v.persistent_volume_claim.claim_name)
                if m.sub_path:
                    src = os.path.join(src, m.sub_path)
                ro = bool(m.read_only or (v.persistent_volume_claim is not None
                                          and v.persistent_volume_claim.read_only))
                self.binds.append((src, m.mount_path, ro))
                continue
            d = self.dir / "volumes" / m.name
            d.mkdir(parents=True, exist_ok=True)
            if v.config_map is not None:
                cm = self.agent.core.read_namespaced_config_map(v.config_map.name, self.ns)
                for k, val in (cm.data or {}).items():
                    (d / k).write_text(val)
            elif v.secret is not None:
                s = self.agent.core.read_namespaced_secret(v.secret.secret_name, self.ns)
                for k, val in (s.data or {}).items():
                    (d / k).write_bytes(base64.b64decode(val))
            target = str(d / m.sub_path) if m.sub_path else str(d)
            local[m.mount_path.rstrip("/")] = target
        return local

    def _kubeconfig(self) -> str | None:
        spec = self.pod.spec
        if spec.automount_service_account_token is False:
            return None
        sa = spec.service_account_name or "default"
        body = client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(
            audiences=["https://kubernetes.default.svc"], expiration_seconds=3600 * 24))
        tok = self.agent.core.create_namespaced_service_account_token(sa, self.ns, body).status.token
        path = self.dir / "kubeconfig"
        cfg = {"apiVersion": "v1", "kind": "Config", "current-context": "pod",
               "clusters": [{"name": "c", "cluster": {"server": self.agent.server_for_pods,
                                                      "insecure-skip-tls-verify": True}}],
               "users": [{"name": f"system:serviceaccount:{self.ns}:{sa}", "user": {"token": tok}}],
               "contexts": [{"name": "pod", "context": {"cluster": "c", "namespace": self.ns,
                                                        "user": f"system:serviceaccount:{self.ns}:{sa}"}}]}
        path.write_text(yaml.safe_dump(cfg))
        return str(path)

    def _field(self, path: str) -> str:
        p = self.pod
        return {"metadata.name": p.metadata.name, "metadata.namespace": p.metadata.namespace,
                "metadata.uid": p.metadata.uid, "status.podIP": self.ip, "status.hostIP": self.agent.host_ip,
                "spec.nodeName": self.agent.node, "spec.serviceAccountName": p.spec.service_account_name or ""
                }.get(path, "")

    @staticmethod
    def _resource(c, ref) -> str:
        """A ``resourceFieldRef`` as the kubelet fills it: the container's request or limit divided by
        the divisor (default 1), rounded up; an unset limit reads as the node's capacity (here: its
        cores), an unset request as 0."""
        from kubernetes.utils.quantity import parse_quantity
        kind, _, name = ref.resource.partition(".")
        have = getattr(c.resources, kind, None) or {}
        if name in have:
            q = parse_quantity(have[name])
        else:
            q = parse_quantity(str(os.cpu_count())) if kind == "limits" and name == "cpu" else 0
        return str(int(-(-q // parse_quantity(ref.divisor or "1"))))

    def prepare(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.setup_network()
        c = self.pod.spec.containers[0]
        self.mounts = self._volumes()
        # The kubelet mounts a file at terminationMessagePath; here the path is rewritten to a file of
        # the pod's folder wherever the command, args or env name it.
        self.term_file = self.dir / "termination-log"
        self.mounts[(c.termination_message_path or "/dev/termination-log").rstrip("/")] = str(self.term_file)

        mps = sorted(self.mounts, key=len, reverse=True)
        pat = re.compile(r"(^|=)(" + "|".join(re.escape(m) for m in mps) + r")(?=/|$)") if mps else None

        def rewrite(s: str) -> str:
            # One pass, at the start of a value or after "=", so a rewritten path is never rewritten again.
            return pat.sub(lambda m: m.group(1) + self.mounts[m.group(2)], s) if pat else s
        image_dirs = [d for img, d in self.agent.image_paths.items() if (c.image or "") == img]
        env = {"PATH": ":".join([*image_dirs, *self.agent.path_prepend, os.path.dirname(sys.executable),
                                 os.environ.get("PATH", "/usr/bin:/bin")]),
               "HOME": str(self.dir), "PYTHONUNBUFFERED": "1", "HOSTNAME": self.name}
        for k in ("XDG_CACHE_HOME", "HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "LANG", "OMP_NUM_THREADS"):
            if k in os.environ:
                env[k] = os.environ[k]
        for e in c.env or []:
            if e.value is not None:
                env[e.name] = rewrite(e.value)
            elif e.value_from is not None and e.value_from.field_ref is not None:
                env[e.name] = self._field(e.value_from.field_ref.field_path)
            elif e.value_from is not None and e.value_from.resource_field_ref is not None:
                env[e.name] = self._resource(c, e.value_from.resource_field_ref)
        kc = self._kubeconfig()
        if kc:
            env["KUBECONFIG"] = kc
        self.env = env
        self.argv = [rewrite(x) for x in (c.command or []) + (c.args or [])]
        if not self.argv:
            self.argv = ["sleep", "infinity"]

    def launch(self) -> None:
        self.term_file.write_bytes(b"")
        out = open(self.dir / "container.log", "ab")
        self.log_offset = out.tell()
        out.write(f"--- start {now()}: {shlex.join(self.argv)}\n".encode())
        out.flush()
        self.proc = subprocess.Popen(["ip", "netns", "exec", self.netns, *self._with_binds(self.argv)], stdout=out,
                                     stderr=subprocess.STDOUT, env=self.env, cwd=str(self.dir),
                                     start_new_session=True)
        (self.dir / "pid").write_text(str(self.proc.pid))
        self.started_at = now()
        self.launched_at = time.time()
        self.ready = False
        self.next_start = None

    def _with_binds(self, argv: list[str]) -> list[str]:
        """argv run in a private mount namespace with the bind mounts made first (same PID: exec)."""
        if not self.binds:
            return argv
        steps = ["set -e"]
        for src, dst, ro in self.binds:
            q, qd = shlex.quote(src), shlex.quote(dst)
            # the mount point is made on the host's file system (an empty directory or file is left)
            steps.append(f"mkdir -p {qd}" if os.path.isdir(src) else
                         f"mkdir -p {shlex.quote(os.path.dirname(dst))}; [ -e {qd} ] || touch {qd}")
            steps.append(f"mount --bind {q} {qd}")
            if ro:
                steps.append(f"mount -o remount,bind,ro {qd}")
        steps.append('exec "$@"')
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", "; ".join(steps), "sh", *argv]

    def _termination_message(self, code: int) -> str:
        """The kubelet's rule: the terminationMessagePath file (at most 4096 bytes); when it is empty,
        the policy is FallbackToLogsOnError and the container failed, the log's last 80 lines or
        2048 bytes, whichever is smaller."""
        msg = self.term_file.read_bytes()[:4096].decode(errors="replace") if self.term_file.exists() else ""
        c = self.pod.spec.containers[0]
        if not msg.strip() and code != 0 and c.termination_message_policy == "FallbackToLogsOnError":
            with open(self.dir / "container.log", "rb") as f:
                f.seek(self.log_offset)
                lines = f.read().decode(errors="replace").splitlines()[1:]  # not our "--- start" line
            msg = "\n".join(lines[-80:])[-2048:]
        return msg

    def _exited(self) -> None:
        """Record the exit as lastState.terminated and schedule the restart after the back-off."""
        code = self.proc.returncode
        if code < 0:  # killed by a signal: the shell's convention, as container runtimes report it
            code = 128 - code
        self.last_terminated = {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                                "startedAt": self.started_at, "finishedAt": now(),
                                "containerID": f"process://{self.proc.pid}"}
        msg = self._termination_message(code)
        if msg:
            self.last_terminated["message"] = msg
        ran = time.time() - self.launched_at
        a = self.agent
        self.backoff = a.backoff_base if ran > 60 or not self.backoff else min(self.backoff * 2, a.backoff_max)
        self.next_start = time.time() + self.backoff

    # ---- probes -------------------------------------------------------------------------------
    def _probe(self, probe) -> bool:
        if probe is None:
            return True
        to = min(probe.timeout_seconds or 1, 2)
        try:
            if probe.http_get is not None:
                port = self._port(probe.http_get.port)
                url = f"http://{self.ip}:{port}{probe.http_get.path or '/'}"
                with urllib.request.urlopen(url, timeout=to) as r:
                    return 200 <= r.status < 400
            if probe.tcp_socket is not None:
                with socket.create_connection((self.ip, self._port(probe.tcp_socket.port)), timeout=to):
                    return True
            if probe._exec is not None:
                r = subprocess.run(["ip", "netns", "exec", self.netns, *probe._exec.command], env=self.env,
                                   capture_output=True, timeout=to + 5)
                return r.returncode == 0
        except Exception:  # noqa: BLE001 - a failed probe
            return False
        return True

    def _port(self, p) -> int:
        if isinstance(p, int) or (isinstance(p, str) and p.isdigit()):
            return int(p)
        for cp in self.pod.spec.containers[0].ports or []:
            if cp.name == p:
                return cp.container_port
        raise ValueError(f"unknown port {p}")

    def tick(self) -> None:
        """Restart an exited process; run the readiness probe when due; report status."""
        if self.terminating or self.done:
            return
        if self.proc is not None and self.proc.poll() is not None:
            if self.next_start is None:
                self.ready = False
                self._exited()
            if time.time() < self.next_start:
                self.report()
                return
            self.restarts += 1
            self.launch()
        c = self.pod.spec.containers[0]
        probe = c.readiness_probe
        period = min((probe.period_seconds or 10) if probe else 1, self.agent.max_probe_period)
        if time.time() - self.last_probe >= period:
            self.last_probe = time.time()
            self.ready = self.proc is not None and self.proc.poll() is None and self._probe(probe)
        self.report()

    def report(self) -> None:
        c = self.pod.spec.containers[0]
        running = self.proc is not None and self.proc.poll() is None
        key = json.dumps([running, self.ready, self.restarts, self.last_terminated, self.next_start is None])
        if key == self.last_status:
            return
        t = now()
        ready = "True" if self.ready else "False"
        state = ({"running": {"startedAt": self.started_at}} if running else
                 {"waiting": {"reason": "CrashLoopBackOff", "message": (
                     f"back-off {self.backoff:g}s restarting failed container={c.name} pod={self.name}_{self.ns}"
                     f"({self.uid})")}})
        status = {"phase": "Running", "hostIP": self.agent.host_ip, "podIP": self.ip, "podIPs": [{"ip": self.ip}],
                  "startTime": self.started_at,
                  "conditions": [{"type": "Initialized", "status": "True", "lastTransitionTime": t},
                                 {"type": "Ready", "status": ready, "lastTransitionTime": t},
                                 {"type": "ContainersReady", "status": ready, "lastTransitionTime": t},
                                 {"type": "PodScheduled", "status": "True", "lastTransitionTime": t}],
                  "containerStatuses": [{"name": c.name, "image": c.image or "", "imageID": "",
                                         "ready": self.ready, "restartCount": self.restarts,
                                         "started": running, "state": state,
                                         **({"lastState": {"terminated": self.last_terminated}}
                                            if self.last_terminated else {})}]}
        try:
            self.agent.core.patch_namespaced_pod_status(self.name, self.ns, {"status": status})
            self.last_status = key
        except ApiException as e:
            if e.status != 404:
                log.warning("status of %s/%s: %s", self.ns, self.name, e.reason)
        except Exception as e:  # noqa: BLE001 - apiserver restarting; retried next tick
            log.warning("status of %s/%s: %s", self.ns, self.name, e)

    # ---- termination --------------------------------------------------------------------------
    def terminate(self, grace: int, delete_object: bool = True) -> None:
        with self.lock:
            if self.terminating:
                return
            self.terminating = True
        c = self.pod.spec.containers[0]
        deadline = time.time() + max(grace, 0)
        try:
            ps = c.lifecycle.pre_stop if c.lifecycle is not None else None
            if ps is not None and self.proc is not None and self.proc.poll() is None:
                try:
                    if ps.http_get is not None:
                        url = f"http://{self.ip}:{self._port(ps.http_get.port)}{ps.http_get.path or '/'}"
                        urllib.request.urlopen(url, timeout=max(1, deadline - time.time())).read()
                    elif ps._exec is not None:
                        subprocess.run(["ip", "netns", "exec", self.netns, *ps._exec.command], env=self.env,
                                       timeout=max(1, deadline - time.time()), capture_output=True)
                except Exception as e:  # noqa: BLE001
                    log.info("preStop of %s/%s: %s", self.ns, self.name, e)
            if self.proc is not None and self.proc.poll() is None:
                try:
                    os.killpg(self.proc.pid, signal.SIGTERM)
                    self.proc.wait(max(0.1, deadline - time.time()))
                except subprocess.TimeoutExpired:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait(5)
                except ProcessLookupError:
                    pass
        finally:
            self.teardown_network()
            self.done = True
        if delete_object:
            try:
                self.agent.core.delete_namespaced_pod(
                    self.name, self.ns, body=client.V1DeleteOptions(
                        grace_period_seconds=0, preconditions=client.V1Preconditions(uid=self.uid)))
            except ApiException as e:
                if e.status not in (404, 409):
                    log.warning("delete %s/%s: %s", self.ns, self.name, e.reason)
            except Exception as e:  # noqa: BLE001
                log.warning("delete %s/%s: %s", self.ns, self.name, e)


class Forwarder:
    """Forwards host_ip:PORT to the apiserver on 127.0.0.1, so pods (in their own network namespaces,
    which can't reach the host's loopback) can use the API, as they would through a Service VIP.

    Like a load balancer with health checks in front of a real control plane, it passes connections
    only while the apiserver's /readyz answers 200 (checked at most once a second); otherwise it closes
    them and the client retries. A restarting apiserver serves requests before its RBAC caches are
    filled and answers them 403; /readyz keeps pods from seeing that window."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int], readyz=None):
        self.target = target
        self.readyz = readyz
        self._ready_at = 0.0
        self._ready = False
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(listen)
        self.sock.listen(128)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            if not self._is_ready():
                c.close()
                continue
            try:
                u = socket.create_connection(self.target, timeout=5)
                u.settimeout(None)
            except OSError:
                c.close()
                continue
            for a, b in ((c, u), (u, c)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _is_ready(self) -> bool:
        if self.readyz is None:
            return True
        now_ = time.monotonic()
        if now_ - self._ready_at >= 1.0:
            self._ready = self.readyz()
            self._ready_at = now_
        return self._ready

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while True:
                d = a.recv(65536)
                if not d:
                    break
                b.sendall(d)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


class Agent:
    def __init__(self, kubeconfig: str, subnet: str, bridge: str, node: str, workdir: str,
                 max_probe_period: float, path_prepend: list[str] | None = None,
                 backoff_base: float = 1.0, backoff_max: float = 16.0):
        config.load_kube_config(kubeconfig)
        self.api = client.ApiClient()
        self.core = client.CoreV1Api(self.api)
        self.api_target = self.api.configuration.host.split("//")[1].rsplit(":", 1)
        self.server_for_pods = f"https://{subnet}.1:6443"
        self.subnet = subnet
        self.bridge = bridge
        self.host_ip = f"{subnet}.1"
        self.node = node
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.max_probe_period = max_probe_period
        self.backoff_base, self.backoff_max = backoff_base, backoff_max
        self.path_prepend = [p for p in (path_prepend or []) if p]
        self.image_paths: dict[str, str] = {}
        self.pods: dict[str, PodRunner] = {}
        self.free_idx = list(range(2, 255))
        self.stopping = threading.Event()

    def apiserver_ready(self) -> bool:
        cfg = self.api.configuration
        auth = cfg.get_api_key_with_prefix("authorization") or cfg.get_api_key_with_prefix("BearerToken") or ""
        req = urllib.request.Request(cfg.host + "/readyz", headers={"Authorization": auth} if auth else {})
        try:
            with urllib.request.urlopen(req, context=ssl._create_unverified_context(), timeout=2) as r:
                return r.status == 200
        except Exception:  # noqa: BLE001 - not ready or unreachable
            return False

    def setup_bridge(self) -> None:
        sh("ip", "link", "delete", self.bridge, check=False)
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{self.host_ip}/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        self.forwarder = Forwarder((self.host_ip, 6443), (self.api_target[0], int(self.api_target[1])),
                                   readyz=self.apiserver_ready)

    def teardown_bridge(self) -> None:
        sh("ip", "link", "delete", self.bridge, check=False)

    def register(self) -> None:
        cap = {"cpu": "64", "memory": "256Gi", "pods": "250", "nvidia.com/gpu": "16", "ephemeral-storage": "100Gi"}
        node = {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": self.node, "labels": {"kubernetes.io/hostname": self.node,
                                                          "kubernetes.io/os": "linux", "tandem.dev/node-agent": "true"}}}
        try:
            self.core.create_node(node)
        except ApiException as e:
            if e.status != 409:
                raise
        self.heartbeat()

    def heartbeat(self) -> None:
        cap = {"cpu": "64", "memory": "256Gi", "pods": "250", "nvidia.com/gpu": "16", "ephemeral-storage": "100Gi"}
        t = now()
        status = {"capacity": cap, "allocatable": cap,
                  "addresses": [{"type": "InternalIP", "address": self.host_ip}, {"type": "Hostname", "address": self.node}],
                  "conditions": [{"type": "Ready", "status": "True", "reason": "NodeAgentReady",
                                  "message": "tandem node agent", "lastHeartbeatTime": t, "lastTransitionTime": t}],
                  "nodeInfo": {"kubeletVersion": "v1.20.2-tandem-node-agent", "architecture": "amd64",
                               "operatingSystem": "linux", "containerRuntimeVersion": "process://tandem",
                               "kernelVersion": os.uname().release, "osImage": "tandem", "kubeProxyVersion": "",
                               "bootID": "", "machineID": "", "systemUUID": ""}}
        self.core.patch_node_status(self.node, {"status": status})
        # The TaintNodesByCondition admission plugin taints a new Node not-ready; the node lifecycle
        # controller (not run here) would lift it once the Node reports Ready. Lift it ourselves.
        n = self.core.read_node(self.node)
        taints = [t for t in (n.spec.taints or []) if not t.key.startswith("node.kubernetes.io/")]
        if len(taints) != len(n.spec.taints or []):
            self.core.patch_node(self.node, {"spec": {"taints": [t.to_dict() for t in taints] or None}})

    def loop(self) -> None:
        last_hb = time.time()
        while not self.stopping.is_set():
            try:
                if time.time() - last_hb > 20:
                    self.heartbeat()
                    last_hb = time.time()
                pods = self.core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={self.node}").items
            except Exception as e:  # noqa: BLE001 - apiserver down: keep pods running, retry
                log.warning("list pods: %s", e)
                self.stopping.wait(1)
                continue
            seen = set()
            for p in pods:
                uid = p.metadata.uid
                seen.add(uid)
                r = self.pods.get(uid)
                if p.metadata.deletion_timestamp is not None:
                    if r is None:
                        self._force_delete(p)
                    elif not r.terminating:
                        grace = p.metadata.deletion_grace_period_seconds
                        if grace is None:
                            grace = p.spec.termination_grace_period_seconds or 30
                        threading.Thread(target=r.terminate, args=(grace,), daemon=True).start()
                    continue
                if p.status is not None and p.status.phase in ("Succeeded", "Failed"):
                    continue
                if r is None:
                    if not self.free_idx:
                        log.error("no free pod addresses")
                        continue
                    r = PodRunner(self, p, self.free_idx.pop(0))
                    self.pods[uid] = r
                    try:
                        r.prepare()
                        r.launch()
                        log.info("started %s/%s at %s: %s", r.ns, r.name, r.ip, shlex.join(r.argv))
                    except Exception as e:  # noqa: BLE001
                        log.exception("start %s/%s failed: %s", r.ns, r.name, e)
                        r.teardown_network()
                        self.pods.pop(uid)
                        self.free_idx.append(r.index)
                        continue
                r.pod = p
                r.tick()
            for uid, r in list(self.pods.items()):
                if uid not in seen and not r.terminating and self._gone(r):
                    threading.Thread(target=r.terminate, args=(0, False), daemon=True).start()
                if r.done:
                    self.pods.pop(uid)
                    self.free_idx.append(r.index)
            self.stopping.wait(0.5)

    def _gone(self, r: PodRunner) -> bool:
        """Whether a pod missing from one listing is really gone (never stop a pod on a partial list)."""
        try:
            p = self.core.read_namespaced_pod(r.name, r.ns)
        except ApiException as e:
            return e.status == 404
        except Exception:  # noqa: BLE001 - apiserver unreachable: keep the pod
            return False
        return p.metadata.uid != r.uid

    def _force_delete(self, p) -> None:
        try:
            self.core.delete_namespaced_pod(p.metadata.name, p.metadata.namespace,
                                            body=client.V1DeleteOptions(grace_period_seconds=0))
        except Exception:  # noqa: BLE001
            pass

    def shutdown(self) -> None:
        self.stopping.set()
        threads = []
        for r in list(self.pods.values()):
            t = threading.Thread(target=r.terminate, args=(5, False), daemon=True)
            t.start()
            threads.append(t)
        for t in threads:
            t.join(15)
        self.teardown_bridge()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kubeconfig", required=True)
    ap.add_argument("--subnet", required=True, help="first three octets of the private /24, e.g. 10.213.40")
    ap.add_argument("--bridge", required=True)
    ap.add_argument("--node", default="tandem-node")
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--max-probe-period", type=float, default=1.0)
    ap.add_argument("--path-prepend", action="append", default=[],
                    help="directories put first on the pods' PATH (e.g. a mock's bin directory)")
    ap.add_argument("--image-path", action="append", default=[], metavar="IMAGE=DIR",
                    help="pods whose image is IMAGE get DIR first on PATH (a stand-in command for that image)")
    ap.add_argument("--backoff-base", type=float, default=1.0,
                    help="first crash back-off in seconds (the kubelet's is 10)")
    ap.add_argument("--backoff-max", type=float, default=16.0,
                    help="longest crash back-off in seconds (the kubelet's is 300)")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    agent = Agent(a.kubeconfig, a.subnet, a.bridge, a.node, a.workdir, a.max_probe_period, a.path_prepend,
                  a.backoff_base, a.backoff_max)
    agent.image_paths = dict(x.split("=", 1) for x in a.image_path)
    agent.setup_bridge()
    signal.signal(signal.SIGTERM, lambda *_: agent.stopping.set())
    signal.signal(signal.SIGINT, lambda *_: agent.stopping.set())
    try:
        agent.register()
        agent.loop()
    finally:
        agent.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
