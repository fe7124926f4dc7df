"""Benchmark datasets, each drawn from a seed and savable (JSON Lines), so that two runs, or two
servers, get identical requests.

Kinds: ``random`` (prompt and output lengths fixed, uniform or log-normal, as vLLM's random dataset),
``sharegpt`` (a ShareGPT-format JSON file, first turns, as vLLM's), ``prefix`` (N system prompts of L
tokens x M questions), ``multiturn`` (sessions whose turns resend the conversation so far, the server's
real answers included) and ``trace`` (a trace file of :mod:`tandem.worker.bench.trace`).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

FORMAT_VERSION = 1


@dataclass
class BenchRequest:
    """One request to send. ``messages`` hold the new messages of this turn (a multi-turn session
    prepends the conversation so far at run time). Token counts are what was asked for."""
    id: str
    messages: list[dict]
    prompt_tokens: int
    output_tokens: int
    prefix_group: int | None = None
    session: int | None = None
    turn: int = 0
    timestamp: float | None = None     # trace datasets: the intended send time (s)
    think_time: float = 0.0            # turns > 0: the pause after the previous answer (s)
    prompt_token_ids: list[int] | None = None   # completions only: send token ids, for exact lengths

    def prompt_text(self) -> str:
        """The prompt of a completions request: the messages' contents, one after another."""
        return "\n\n".join(m["content"] for m in self.messages)


@dataclass
class Dataset:
    kind: str
    params: dict
    requests: list[BenchRequest] = field(default_factory=list)

    @property
    def multiturn(self) -> bool:
        return any(r.session is not None for r in self.requests)

    def first_turns(self) -> list[BenchRequest]:
        """The requests on the up-front schedule (every request, or each session's first turn)."""
        return [r for r in self.requests if r.turn == 0]

    def save(self, path: str | Path) -> None:
        with open(path, "w") as f:
            f.write(json.dumps({"tandem_dataset": FORMAT_VERSION, "kind": self.kind, "params": self.params}) + "\n")
            for r in self.requests:
                f.write(json.dumps(asdict(r)) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Dataset":
        """Raises ValueError when the file is not a saved dataset of this format version."""
        lines = Path(path).read_text().splitlines()
        head = json.loads(lines[0]) if lines else {}
        if head.get("tandem_dataset") != FORMAT_VERSION:
            raise ValueError(f"{path}: not a tandem dataset (version {FORMAT_VERSION})")
        return cls(head["kind"], head["params"], [BenchRequest(**json.loads(x)) for x in lines[1:] if x.strip()])


def lengths(rng: np.random.Generator, n: int, mean: int, dist: str = "fixed", spread: float = 0.0) -> np.ndarray:
    """``n`` token lengths >= 1 around ``mean``.

    ``fixed``: all ``mean``. ``uniform``: [mean*(1-spread), mean*(1+spread)] (vLLM's range ratio).
    ``lognormal``: median ``mean``, sigma ``spread`` (a long tail, like real prompts).
    Raises ValueError for another dist."""
    if dist == "fixed":
        x = np.full(n, float(mean))
    elif dist == "uniform":
        x = rng.uniform(mean * (1 - spread), mean * (1 + spread), n)
    elif dist == "lognormal":
        x = rng.lognormal(np.log(mean), spread, n)
    else:
        raise ValueError(f"unknown length distribution {dist!r} (fixed, uniform, lognormal)")
    return np.maximum(1, np.rint(x)).astype(int)


def random_dataset(maker, n: int, input_len: int, output_len: int, dist: str = "fixed", spread: float = 0.0,
                   seed: int = 0) -> Dataset:
    rng = np.random.default_rng(seed)
    ins, outs = lengths(rng, n, input_len, dist, spread), lengths(rng, n, output_len, dist, spread)
    reqs = [BenchRequest(f"r{i}", [{"role": "user", "content": maker.text(rng, int(a))}], int(a), int(b))
            for i, (a, b) in enumerate(zip(ins, outs))]
    return Dataset("random", dict(n=n, input_len=input_len, output_len=output_len, dist=dist, spread=spread,
                                  seed=seed), reqs)


def sharegpt_dataset(maker, path: str, n: int, seed: int = 0, output_len: int | None = None,
                     max_len: int = 1024) -> Dataset:
    """First human turn as the prompt; the output length is the first gpt reply's token count (or
    ``output_len``). Conversations shorter than 4 tokens or longer than ``max_len`` are skipped, as
    vLLM does. Raises ValueError when the file holds fewer than ``n`` usable conversations."""
    data = json.loads(Path(path).read_text())
    order = np.random.default_rng(seed).permutation(len(data))
    reqs = []
    for i in order:
        conv = data[int(i)].get("conversations") or []
        if len(conv) < 2 or conv[0].get("from") != "human":
            continue
        prompt, reply = conv[0]["value"], conv[1]["value"]
        p = maker.count(prompt)
        o = output_len or maker.count(reply)
        if p < 4 or o < 4 or p + o > max_len:
            continue
        reqs.append(BenchRequest(f"s{len(reqs)}", [{"role": "user", "content": prompt}], p, o))
        if len(reqs) == n:
            break
    if len(reqs) < n:
        raise ValueError(f"{path}: only {len(reqs)} usable conversations, {n} asked")
    return Dataset("sharegpt", dict(path=str(path), n=n, seed=seed, output_len=output_len), reqs)


def prefix_dataset(maker, num_prefixes: int, prefix_len: int, questions: int, question_len: int,
                   output_len: int, seed: int = 0) -> Dataset:
    """N system prompts of ``prefix_len`` tokens, each with M questions, in a seeded shuffled order:
    the long-system-prompt case a prefix cache is for."""
    rng = np.random.default_rng(seed)
    systems = [maker.text(rng, prefix_len) for _ in range(num_prefixes)]
    reqs = [BenchRequest(f"p{g}q{q}", [{"role": "system", "content": systems[g]},
                                       {"role": "user", "content": maker.text(rng, question_len)}],
                         prefix_len + question_len, output_len, prefix_group=g)
            for g in range(num_prefixes) for q in range(questions)]
    reqs = [reqs[i] for i in rng.permutation(len(reqs))]
    return Dataset("prefix", dict(num_prefixes=num_prefixes, prefix_len=prefix_len, questions=questions,
                                  question_len=question_len, output_len=output_len, seed=seed), reqs)


def multiturn_dataset(maker, sessions: int, turns: int, user_len: int, output_len: int, think_time: float = 1.0,
                      system_len: int = 0, seed: int = 0) -> Dataset:
    """``sessions`` conversations of ``turns`` turns. Each later turn waits an exponential think time
    (mean ``think_time`` s) after the previous answer, then resends the whole conversation."""
    rng = np.random.default_rng(seed)
    reqs = []
    for s in range(sessions):
        for t in range(turns):
            msgs = [{"role": "user", "content": maker.text(rng, user_len)}]
            if t == 0 and system_len:
                msgs.insert(0, {"role": "system", "content": maker.text(rng, system_len)})
            think = float(rng.exponential(think_time)) if t and think_time > 0 else 0.0
            reqs.append(BenchRequest(f"m{s}t{t}", msgs, user_len + (system_len if t == 0 else 0), output_len,
                                     session=s, turn=t, think_time=think))
    return Dataset("multiturn", dict(sessions=sessions, turns=turns, user_len=user_len, output_len=output_len,
                                     think_time=think_time, system_len=system_len, seed=seed), reqs)


def trace_dataset(maker, path: str, n: int | None = None, prefix_len: int = 64, seed: int = 0) -> Dataset:
    """Requests of a trace file (:func:`tandem.worker.bench.trace.read_trace`): its timestamps become
    the schedule; records of one ``prefix_group`` share their first ``prefix_len`` tokens (capped at the
    prompt length) as a system message. A record with ``hash_ids`` (an imported Mooncake trace) gets a
    prompt of one text per block of the header's ``block_tokens`` tokens, the same id giving the same
    text, so requests that share ids share their prompt's prefix as the trace says; a prompt's last
    block, where it is shorter, is the head of its id's text (an id seen at 300 and 480 tokens shares
    the first 300); tokens past the listed blocks are fresh. Raises ValueError for a trace with no
    requests."""
    from tandem.worker.bench.trace import read_trace
    header, records = read_trace(path)
    if not records:
        raise ValueError(f"{path}: no requests (a tandem trace: `tandem bench trace` writes one, "
                         "`tandem bench trace import` converts an Azure or Mooncake trace)")
    block = int((header.get("params") or {}).get("block_tokens") or 512)
    records = records[:n] if n else records
    rng = np.random.default_rng(seed)
    prefixes: dict = {}
    blocks: dict = {}
    reqs = []
    for i, r in enumerate(records):
        p, g = int(r["prompt_tokens"]), r.get("prefix_group")
        msgs, shared = [], 0
        if r.get("hash_ids"):
            parts = []
            for j, h in enumerate(r["hash_ids"]):
                size = min(block, p - j * block)
                if size <= 0:
                    break
                if h not in blocks:
                    blocks[h] = maker.text(rng, block)
                parts.append(blocks[h] if size == block else maker.head(blocks[h], size))
            rest = p - min(p, len(r["hash_ids"]) * block)
            if rest:
                parts.append(maker.text(rng, rest))
            reqs.append(BenchRequest(f"t{i}", [{"role": "user", "content": "".join(parts)}], p,
                                     int(r["output_tokens"]), timestamp=float(r["timestamp"])))
            continue
        if g is not None and prefix_len:
            shared = min(prefix_len, p - 1)
            if (g, shared) not in prefixes:
                prefixes[(g, shared)] = maker.text(rng, shared)
            msgs.append({"role": "system", "content": prefixes[(g, shared)]})
        msgs.append({"role": "user", "content": maker.text(rng, p - shared)})
        reqs.append(BenchRequest(f"t{i}", msgs, p, int(r["output_tokens"]), prefix_group=g,
                                 timestamp=float(r["timestamp"])))
    return Dataset("trace", dict(path=str(path), n=len(reqs), prefix_len=prefix_len, seed=seed), reqs)
