"""Full vs delta weight sync between two nodes over a rate-limited link (root; Linux namespaces):

    python benchmarks/weight_sync_link.py [--rates 1gbit,10gbit] [--steps 5] [--lrs 1e-6] [--layers 6]
    python benchmarks/weight_sync_link.py --smoke       # CI: a tiny model, 3 steps, 1 Gbit/s

Two nodes are built as in tests/multinode/nodes.py (network, UTS and mount namespaces, a bridge in
a namespace of its own; nothing added to the host's namespace). Each node's veth is shaped with
`tc qdisc ... tbf rate R`, so what crosses between the nodes costs what it would on a link of that
speed. torchrun (static rendezvous) starts 2 ranks per node: node0 holds the two trainer ranks,
node1 the two bf16 engine ranks, and `benchmarks/weight_sync.py --delta` runs on them unchanged
(weight_sync_delta.py: real Adam steps, `full`, `delta` and `delta+zstd` in alternation, bits
compared after every step). Per link speed it prints that benchmark's table.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from megarl.storage.plain_state import load_plain  # noqa: E402
from tests.multinode.nodes import NodeSet  # noqa: E402

PORT = 29633


def shape_link(ns: NodeSet, rate: str) -> None:
    # A bucket of 10 ms at the rate: tbf needs burst >= rate / HZ to reach the rate at all.
    bits = float(rate.lower().replace("gbit", "e9").replace("mbit", "e6"))
    burst = max(int(bits / 8 / 100), 64 * 1024)
    for node in ns:
        got = subprocess.run(["nsenter", "-t", str(node.holder.pid), "--net", "tc", "qdisc", "replace", "dev", "eth0",
                              "root", "tbf", "rate", rate, "burst", str(burst), "latency", "100ms"],
                             capture_output=True, text=True, timeout=30)
        if got.returncode != 0:
            raise SystemExit(f"weight_sync_link: tc on {node.name}: {got.stderr.strip()}")


def run_at(ns: NodeSet, a, model: str, results: str) -> list:
    procs = []
    for node in ns:
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend=static", "--nnodes=2",
               f"--node-rank={node.index}", "--master-addr=node0", f"--master-port={PORT}", f"--local-addr={node.addr}",
               "--nproc-per-node=2", "--max-restarts=0", os.path.join(REPO, "benchmarks/weight_sync.py"), "--delta",
               f"--steps={a.steps}", f"--lrs={a.lrs}", f"--layers={a.layers}", f"--hidden={a.hidden}",
               f"--vocab={a.vocab}", f"--bucket-mb={a.bucket_mb}", f"--anchor-every={a.anchor_every}",
               "--no-disk", f"--model-dir={model}", f"--results-dir={results}", *([] if a.zstd else ["--no-zstd"])]
        procs.append(ns.popen(node, cmd, cwd=REPO, env=env))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"weight_sync_link: torchrun exited {codes}")
    return [load_plain(os.path.join(results, f"rank{r}.pt"))["result"] for r in range(4)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="1gbit,10gbit", help="tc tbf rates, slowest first")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lrs", default="1e-6")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--bucket-mb", type=float, default=64)
    ap.add_argument("--anchor-every", type=int, default=20)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--no-zstd", dest="zstd", action="store_false")
    ap.add_argument("--smoke", action="store_true", help="CI: a tiny model, 3 steps, one link speed")
    a = ap.parse_args()
    if a.smoke:
        vars(a).update(rates="1gbit", steps=3, layers=2, hidden=64, vocab=512, bucket_mb=0.05, anchor_every=4,
                       zstd=False)
    why = NodeSet.refusal()
    if why:
        raise SystemExit(f"weight_sync_link: {why}")
    import weight_sync
    import weight_sync_delta as wd
    from megarl.models.tiny import make_tiny_hf
    with tempfile.TemporaryDirectory() as tmp, NodeSet(2) as ns:
        model = os.path.join(tmp, "model")
        make_tiny_hf(model, "qwen2", tokenizer=False, **weight_sync.shape(a.layers, a.hidden, a.vocab))
        for rate in a.rates.split(","):
            shape_link(ns, rate)
            results = os.path.join(tmp, rate)
            os.makedirs(results)
            begin = time.perf_counter()
            ranks = run_at(ns, a, model, results)
            print(f"\n== link {rate} (tc tbf on each node's veth): trainer ranks 0-1 on node0, bf16 engines 2-3 on "
                  f"node1; Qwen2 {a.layers} layers, hidden {a.hidden}; {a.steps} steps; "
                  f"load average {os.getloadavg()[0]:.1f} ({time.perf_counter() - begin:.0f} s)", flush=True)
            wd.report(ranks, a)


if __name__ == "__main__":
    main()
