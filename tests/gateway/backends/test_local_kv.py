"""The batch's keys and values (``kv.py``): buffers that grow in place hold what concatenation would, rows join and
leave as padding and indexing would have them, and the engine's greedy output is transformers' own, token for
token, across several buffer reallocations and rows joining and leaving."""

from __future__ import annotations

import threading
from pathlib import Path

from tests.extras import skip_without

skip_without("local")

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from gateway.backends.local.engine import Engine
from gateway.backends.local.heap import map_large_allocations
from gateway.backends.local.jobs import Finish, Job, JobEvent, Token
from gateway.backends.local.kv import BLOCK, MAPPED, BatchCache, zeros
from gateway.backends.local.loading import load_model
from gateway.backends.local.sampling import SamplingParams

SHAPE = (2, 3, 4)  # rows, heads, head dim (positions go between heads and head dim)


def _positions(n: int, seed: int, rows: int = SHAPE[0]) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (rows, SHAPE[1], n, SHAPE[2])
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


def _filled(chunks: list[int], seed: int = 0, rows: int = SHAPE[0]) -> tuple[BatchCache, list[torch.Tensor]]:
    """A two-layer cache fed ``chunks`` positions at a time, and what ``torch.cat`` makes of the same (layer 0)."""
    cache, keys, values = BatchCache(2), [], []
    for i, n in enumerate(chunks):
        k, v = _positions(n, seed + i, rows)
        for layer in range(2):
            cache.update(k + layer, v + layer, layer)
        keys.append(k)
        values.append(v)
    return cache, [torch.cat(keys, dim=2), torch.cat(values, dim=2)]


def test_a_cache_that_grows_in_place_holds_what_concatenation_does() -> None:
    cache, (keys, values) = _filled([100] + [1] * 60)  # crosses a block boundary while decoding
    layer = cache.layers[0]
    assert layer.length == 160 and cache.get_seq_length() == 160
    assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
    assert torch.equal(cache.layers[1].keys, keys + 1)
    buffer = layer.keys.untyped_storage().nbytes() // (layer.keys.element_size() * 2 * 3 * 4)
    assert buffer == 2 * BLOCK  # reallocated once, at 128 positions, to room for one more block


def test_rows_join_right_aligned_and_leave_with_their_padding_cut() -> None:
    long, (long_keys, long_values) = _filled([50])
    short, (short_keys, _) = _filled([20], seed=5, rows=1)
    long.join(short)
    assert [layer.length for layer in long.layers] == [50, 50] and short.layers[0].keys is None  # let go
    expected = torch.cat([long_keys, F.pad(short_keys, (0, 0, 30, 0))])
    assert torch.equal(long.layers[0].keys, expected)
    storage = long.layers[0].keys.untyped_storage().data_ptr()
    long.select(torch.tensor([2, 1]), start=30)  # the short row first, then the second long one, from position 30
    assert long.layers[0].length == 20
    assert long.layers[0].keys.untyped_storage().data_ptr() == storage  # compacted in place, no new buffer
    assert torch.equal(long.layers[0].keys, torch.stack([short_keys[0], long_keys[1, :, 30:]]))
    assert torch.equal(long.layers[1].values[1], long_values[1, :, 30:] + 1)
    long.update(*_positions(1, 9), 0)  # and it goes on growing
    assert long.layers[0].length == 21


def test_rows_left_behind_by_a_select_are_let_go_when_the_buffer_next_grows() -> None:
    cache, (keys, _) = _filled([BLOCK - 2], rows=4)
    cache.select(torch.tensor([3, 0]), start=0)
    layer = cache.layers[0]
    assert layer.keys.untyped_storage().nbytes() == 4 * 3 * BLOCK * 4 * 4  # still the four rows' buffer
    more = _positions(4, 7)
    cache.update(*more, 0)  # past the buffer's room: reallocated for the two rows kept
    layer = cache.layers[0]
    assert layer.keys.untyped_storage().nbytes() == 2 * 3 * 2 * BLOCK * 4 * 4
    assert torch.equal(layer.keys, torch.cat([keys[[3, 0]], more[0]], dim=2))


def test_large_buffers_are_zeros_of_their_own_and_small_ones_plain() -> None:
    big = zeros((MAPPED // 4,), torch.float32)
    assert big.abs().sum() == 0 and big.untyped_storage().nbytes() == MAPPED
    big[:10] = 1
    assert big.sum() == 10
    assert torch.equal(zeros((3, 2), torch.float32), torch.zeros(3, 2))
    assert map_large_allocations()  # this suite runs on glibc


def _greedy_reference(model_dir: Path, prompt: list[int], tokens: int) -> list[int]:
    """transformers' own greedy decoding: its SDPA attention, its DynamicCache, one sequence alone."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_the_engine_decodes_as_transformers_does_across_reallocations(tiny_model_dir: Path) -> None:
    loaded = load_model(str(tiny_model_dir))
    engine = Engine(loaded, max_batch_size=4)
    prompts = {"long": loaded.tokenizer.encode("a prompt of a few words, longer than the other " * 3),
               "short": loaded.tokenizer.encode("short")}
    limits = {"long": 300, "short": 150}  # both cross block boundaries; the short row leaves first
    tokens: dict[str, list[int]] = {name: [] for name in prompts}
    finishes: list[str] = []

    def job(name: str) -> Job:
        def deliver(events: list[JobEvent]) -> None:
            tokens[name].extend(e.token_id for e in events if isinstance(e, Token))
            finishes.extend(e.reason for e in events if isinstance(e, Finish))
            if name == "long" and len(tokens[name]) == 20:  # the short one joins the running batch
                engine.submit(job("short"))
        return Job(prompts[name], SamplingParams(temperature=0, max_tokens=limits[name], ignore_eos=True), deliver)

    engine.submit(job("long"))
    thread = threading.Thread(target=engine.run)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive() and finishes == ["length", "length"]
    for name, prompt in prompts.items():
        assert tokens[name] == _greedy_reference(tiny_model_dir, prompt, limits[name]), name
