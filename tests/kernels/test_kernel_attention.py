"""Paged prefill and decode attention: Triton against the float64 reference.

Shapes are drawn with a fixed seed: ragged lengths, lengths on and around block boundaries, a cached
prefix of 0 and of many blocks, single tokens, a sequence with no new tokens, GQA ratios 1/2/4/8, head
dims 64 and 128 (and a padded 80). Blocks are scattered through the cache, slots nobody owns hold
large garbage (a kernel that reads them gets a wrong answer) and outputs are NaN-poisoned.
"""
import random
import zlib

import pytest
import torch

from kernel_helpers import FP8_TOL_SAME_QUANT, TOL, assert_close
from tandem.kernels import attention
from tandem.kernels.rope import to_cache_dtype

GARBAGE = 300.0


def build_cache(lens, hk, d, bs, dtype, extra_blocks=3):
    """A paged cache holding ``lens[b]`` random positions per sequence in scattered blocks."""
    need = [(n + bs - 1) // bs for n in lens]
    num_blocks = sum(need) + extra_blocks
    kc = torch.full((num_blocks, bs, hk, d), GARBAGE, dtype=dtype)
    vc = torch.full((num_blocks, bs, hk, d), -GARBAGE, dtype=dtype)
    order = torch.randperm(num_blocks).tolist()
    width = max(need) + 1
    tables = torch.zeros(len(lens), width, dtype=torch.int32)  # padding ids: valid, never read
    for b, (n, nb) in enumerate(zip(lens, need)):
        ids = [order.pop() for _ in range(nb)]
        tables[b, :nb] = torch.tensor(ids, dtype=torch.int32)
        flat_k = kc[ids].flatten(0, 1)
        flat_v = vc[ids].flatten(0, 1)
        flat_k[:n] = torch.randn(n, hk, d, dtype=dtype)
        flat_v[:n] = torch.randn(n, hk, d, dtype=dtype)
        kc[ids] = flat_k.view(nb, bs, hk, d)
        vc[ids] = flat_v.view(nb, bs, hk, d)
    return kc, vc, tables


def draw_prefill_batch(rng: random.Random, bs: int):
    """(prefix, q_len) pairs covering the edge cases, plus a random one."""
    pool = [(0, 1), (0, bs), (0, bs + 1), (3 * bs, bs - 1), (5 * bs + 3, rng.randint(1, 40)),
            (rng.randint(1, 3 * bs), 1), (0, rng.randint(2, 50)), (2 * bs, 0), (bs - 1, 2)]
    batch = rng.sample(pool, rng.randint(2, 4))
    batch.append((rng.randint(0, 4 * bs), rng.randint(1, 3 * bs)))
    rng.shuffle(batch)
    return batch


# (dtype, GQA ratio, Hk, head dim, block size); every ratio and both dtypes, head dims 64 and 128
PREFILL_CASES = [
    (torch.float32, 1, 2, 64, 16), (torch.float16, 1, 1, 128, 16),
    (torch.float32, 2, 1, 128, 8), (torch.float16, 2, 2, 64, 16),
    (torch.float32, 4, 1, 64, 16), (torch.float16, 4, 1, 128, 32),
    (torch.float32, 8, 1, 64, 16), (torch.float16, 8, 1, 64, 8),
    (torch.float32, 3, 3, 64, 16),   # SmolLM2: 9 q / 3 kv heads
    (torch.float16, 2, 1, 80, 5),    # a padded head dim and an odd block size
]


def _case_id(c):
    return f"{str(c[0])[6:]}-g{c[1]}-hk{c[2]}-d{c[3]}-bs{c[4]}"


def _rng(case, draw):
    return random.Random(zlib.crc32(f"{_case_id(case)}/{draw}".encode()))  # fixed across runs


@pytest.fixture(params=[False, True], ids=["gather", "tma"])
def tma(request, monkeypatch):
    """Prefill through pointer gathers, or through tensor descriptors (TMA) where the blocks allow."""
    from tandem.kernels import prefill
    monkeypatch.setitem(prefill.PREFILL_CONFIG, "tma", request.param)
    return request.param


@pytest.mark.parametrize("draw", [0, 1])
@pytest.mark.parametrize("case", PREFILL_CASES, ids=_case_id)
def test_prefill_attention(poison, tma, case, draw):
    dtype, group, hk, d, bs = case
    rng = _rng(case, draw)
    torch.manual_seed(draw)
    batch = draw_prefill_batch(rng, bs)
    lens = [p + n for p, n in batch]
    qlens = [n for _, n in batch]
    kc, vc, tables = build_cache(lens, hk, d, bs, dtype)
    cu = torch.tensor([0] + qlens, dtype=torch.int32).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu[-1]), group * hk, d, dtype=dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scale = d ** -0.5
    out = attention.prefill_attention_triton(q, kc, vc, tables, cu, seq_lens, scale)
    ref = attention.prefill_attention_ref(q.double(), kc.double(), vc.double(), tables, cu,
                                          seq_lens, scale)
    assert_close(out, ref, TOL[dtype], f"prefill {batch}")


DECODE_CASES = [  # (dtype, GQA ratio, Hk, head dim, block size, forced splits)
    (torch.float32, 1, 2, 64, 16, None), (torch.float16, 1, 1, 128, 16, 3),
    (torch.float32, 2, 2, 128, 8, 1), (torch.float16, 2, 1, 64, 16, None),
    (torch.float32, 4, 1, 64, 16, 5), (torch.float16, 4, 2, 128, 32, None),
    (torch.float32, 8, 1, 128, 16, 2), (torch.float16, 8, 1, 64, 8, 4),
    (torch.float32, 3, 3, 64, 16, None),
]


@pytest.mark.parametrize("draw", [0, 1])
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: _case_id(c) + f"-s{c[5]}")
def test_decode_attention(poison, case, draw):
    dtype, group, hk, d, bs, splits = case
    rng = _rng(case, draw)
    torch.manual_seed(draw)
    pool = [1, bs, bs + 1, 2 * bs - 1, 7 * bs, rng.randint(2, 9 * bs), rng.randint(2, 3 * bs)]
    lens = rng.sample(pool, rng.randint(1, 5))
    kc, vc, tables = build_cache(lens, hk, d, bs, dtype)
    q = torch.randn(len(lens), group * hk, d, dtype=dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = attention.decode_attention_triton(q, kc, vc, tables, seq_lens, d ** -0.5, num_splits=splits)
    ref = attention.decode_attention_ref(q.double(), kc.double(), vc.double(), tables, seq_lens,
                                         d ** -0.5)
    assert_close(out, ref, TOL[dtype], f"decode lens={lens}")


def _fp8_cache(kc, vc, kv_scale):
    return to_cache_dtype(kc, torch.float8_e4m3fn, kv_scale), to_cache_dtype(vc, torch.float8_e4m3fn, kv_scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_attention_fp8_kv_cache(poison, tma, dtype):
    """FP8 KV cache with a per-tensor scale, against float64 on the same quantized cache."""
    hk, group, d, bs, kv_scale = 2, 2, 64, 16, 0.02
    lens, qlens = [40, 17], [9, 17]
    kc, vc, tables = build_cache(lens, hk, d, bs, torch.float32)
    kc8, vc8 = _fp8_cache(kc, vc, kv_scale)
    tol = max(FP8_TOL_SAME_QUANT, TOL[dtype])
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    cu = torch.tensor([0, 9, 26], dtype=torch.int32)
    q = torch.randn(26, group * hk, d, dtype=dtype)
    out = attention.prefill_attention_triton(q, kc8, vc8, tables, cu, seq_lens, d ** -0.5,
                                             kv_scale=kv_scale)
    ref = attention.prefill_attention_ref(q.double(), kc8, vc8, tables, cu, seq_lens, d ** -0.5,
                                          kv_scale=kv_scale)
    assert_close(out, ref, tol, "prefill fp8 kv")
    qd = torch.randn(2, group * hk, d, dtype=dtype)
    out = attention.decode_attention_triton(qd, kc8, vc8, tables, seq_lens, d ** -0.5,
                                            kv_scale=kv_scale, num_splits=2)
    ref = attention.decode_attention_ref(qd.double(), kc8, vc8, tables, seq_lens, d ** -0.5,
                                         kv_scale=kv_scale)
    assert_close(out, ref, tol, "decode fp8 kv")


def test_prefill_matches_decode_on_last_token():
    """A one-token prefill chunk after a long prefix is a decode step: both kernels agree."""
    hk, group, d, bs = 1, 4, 64, 16
    lens = [50, 3]
    kc, vc, tables = build_cache(lens, hk, d, bs, torch.float32)
    q = torch.randn(2, group * hk, d)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    a = attention.prefill_attention_triton(q, kc, vc, tables, cu, seq_lens, 0.125)
    b = attention.decode_attention_triton(q, kc, vc, tables, seq_lens, 0.125)
    assert_close(a, b.double(), 1e-5, "prefill vs decode")


@pytest.mark.parametrize("seed", range(6))
def test_random_configurations(poison, seed):
    """Fully random draws: dtype, GQA ratio, head dim, block size, batch, prefixes, split count."""
    rng = random.Random(1000 + seed)
    torch.manual_seed(1000 + seed)
    dtype = rng.choice([torch.float32, torch.float16])
    group, hk = rng.choice([1, 2, 4, 8]), rng.choice([1, 2])
    d, bs = rng.choice([64, 128]), rng.choice([4, 8, 16, 32])
    batch = [(rng.choice([0, rng.randint(1, 6 * bs)]), rng.randint(1, 2 * bs + 3))
             for _ in range(rng.randint(1, 4))]
    lens = [p + n for p, n in batch]
    kc, vc, tables = build_cache(lens, hk, d, bs, dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    cu = torch.tensor([0] + [n for _, n in batch], dtype=torch.int32).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu[-1]), group * hk, d, dtype=dtype)
    what = f"{dtype} g{group} hk{hk} d{d} bs{bs} {batch}"
    out = attention.prefill_attention_triton(q, kc, vc, tables, cu, seq_lens, d ** -0.5)
    ref = attention.prefill_attention_ref(q.double(), kc.double(), vc.double(), tables, cu, seq_lens, d ** -0.5)
    assert_close(out, ref, TOL[dtype], "prefill " + what)
    qd = torch.randn(len(lens), group * hk, d, dtype=dtype)
    splits = rng.choice([None, 1, 2, 5])
    out = attention.decode_attention_triton(qd, kc, vc, tables, seq_lens, d ** -0.5, num_splits=splits)
    ref = attention.decode_attention_ref(qd.double(), kc.double(), vc.double(), tables, seq_lens, d ** -0.5)
    assert_close(out, ref, TOL[dtype], f"decode splits={splits} " + what)


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_padding_rows_stay_finite(splits):
    """A row with seq_len 0 (how a CUDA-graph batch is padded) yields zeros, never NaN."""
    kc, vc, tables = build_cache([20, 1], 1, 64, 16, torch.float32)
    q = torch.randn(2, 2, 64)
    seq_lens = torch.tensor([20, 0], dtype=torch.int32)
    out = attention.decode_attention_triton(q, kc, vc, tables, seq_lens, 0.125, num_splits=splits)
    assert torch.isfinite(out).all() and not out[1].any()
    ref = attention.decode_attention_ref(q[:1].double(), kc.double(), vc.double(), tables[:1], seq_lens[:1], 0.125)
    assert_close(out[:1], ref, 1e-4, "real row")


def test_prefill_ignores_nan_in_stale_slots(tma):
    """Slots past a sequence's end may hold anything, NaN included (a TMA tile loads them whole)."""
    from tandem.kernels import prefill
    hk, group, d, bs = 1, 2, 64, 32
    lens, qlens = [45, 20], [45, 3]
    kc, vc, tables = build_cache(lens, hk, d, bs, torch.float32)
    for b, n in enumerate(lens):  # poison the tail of each sequence's last block
        last = int(tables[b, (n - 1) // bs])
        kc[last, n % bs or bs:] = float("nan")
        vc[last, n % bs or bs:] = float("nan")
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    cu = torch.tensor([0, 45, 48], dtype=torch.int32)
    q = torch.randn(48, group * hk, d)
    assert prefill._use_tma(q, kc, vc, prefill.prefill_config(d, q.dtype)[1], d) == tma
    out = attention.prefill_attention_triton(q, kc, vc, tables, cu, seq_lens, 0.125)
    ref = attention.prefill_attention_ref(q.double(), kc.double(), vc.double(), tables, cu, seq_lens, 0.125)
    assert_close(out, ref, 1e-4, "stale NaN slots")
