"""What the parity tests share: Sluice's logits and greedy tokens against Hugging Face transformers'
on tiny checkpoints, on the CPU (fp32) and on a GPU (forwards under sync debug mode)."""
from __future__ import annotations

import torch

from scheduler.messages.to_scheduler import SamplingParams
from worker.batch import SequenceChunk
from worker.runner import ModelRunner, RunnerConfig
from worker.runner_config import ExpertOptions

VOCAB, TOL, GREEDY = 128, 1e-4, SamplingParams()
NEAR_TIE = 2e-2  # logits this close may swap under TF32 rounding


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """The relative error of ``a`` against the reference ``b``, both taken to float32 on the host."""
    return ((a.float().cpu() - b.float().cpu()).norm() / b.float().norm()).item()


def random_ids(n: int, seed: int) -> list[int]:
    """``n`` token ids below ``VOCAB``, drawn from a generator of their own seed."""
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def cpu_runner(model_dir, state_slots: int = RunnerConfig.state_slots, **experts) -> ModelRunner:
    """A float32 runner on the CPU (pages of 4, 512 KV tokens) with ``experts`` as its ExpertOptions."""
    return ModelRunner(RunnerConfig(str(model_dir), device="cpu", dtype="float32", page_size=4, kv_tokens=512,
                                    state_slots=state_slots, experts=ExpertOptions(**experts)))


def pages(runner: ModelRunner, tokens: int) -> list[int]:
    """Enough free KV pages of ``runner`` for ``tokens`` tokens."""
    return runner.kv_pool.allocate(runner.kv_pool.pages_for(tokens))


def step(runner: ModelRunner, chunks: list[SequenceChunk]):
    """One greedy forward of ``chunks``; a hybrid runner must have the state slots they name."""
    if runner.state_pool is not None:
        assert max(c.state_slot for c in chunks) < runner.state_pool.num_slots, "too few state slots for the test"
    return runner.forward(chunks, [GREEDY] * len(chunks), [0] * len(chunks))


def check(logits: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Asserts ``logits`` within relative error ``TOL`` of transformers' ``ref``, naming ``what`` if not."""
    err = rel_err(logits, ref)
    assert err < TOL, f"{what}: relative error {err:.2e}"


# ==== on the CPU: steps of a runner against transformers' logits ====


def check_prefill_batch(runner: ModelRunner, prompts: list[list[int]], refs: list[torch.Tensor],
                        state_slots: list[int] | None = None) -> None:
    """Prefills ``prompts`` in one step: each one's last logits match its entry of ``refs``, and its
    next token is their argmax. Sequence b keeps its recurrent state in ``state_slots[b]``."""
    slots = state_slots or [-1] * len(prompts)
    out = step(runner, [SequenceChunk(p, 0, pages(runner, len(p)), state_slot=s) for p, s in zip(prompts, slots)])
    for b, (p, ref) in enumerate(zip(prompts, refs)):
        check(out.logits[b], ref, f"prompt of {len(p)}")
        assert out.next_tokens[b].item() == ref.argmax().item()


def check_decode_batch(runner: ModelRunner, seqs: list[list[int]], lengths: tuple[int, ...], decode: int,
                       refs: list[torch.Tensor], state_slots: list[int] | None = None) -> None:
    """Prefills the first ``lengths[b]`` tokens of each of ``seqs`` in one step, then decodes ``decode``
    more of them a step, all in one batch: each step's logits match ``refs`` at their positions."""
    slots = state_slots or [-1] * len(seqs)
    seq_pages = [pages(runner, len(s)) for s in seqs]
    step(runner, [SequenceChunk(s[:n], 0, pg, state_slot=slot)
                  for s, n, pg, slot in zip(seqs, lengths, seq_pages, slots)])
    for i in range(decode):
        out = step(runner, [SequenceChunk([s[n + i]], n + i, pg, state_slot=slot)
                            for s, n, pg, slot in zip(seqs, lengths, seq_pages, slots)])
        for b, (ref, n) in enumerate(zip(refs, lengths)):
            check(out.logits[b], ref[n + i], f"sequence {b} decoding at {n + i}")


def check_chunks_then_decode(runner: ModelRunner, ids: list[int], ref: torch.Tensor, ends: tuple[int, ...],
                             state_slot: int = -1) -> None:
    """Prefills ``ids`` in chunks ending at ``ends``, then decodes the rest a token a step: every step's
    last logits match ``ref``, transformers' logits of ``ids``, at their position."""
    seq_pages = pages(runner, len(ids))
    for start, end in zip((0,) + ends, ends):
        out = step(runner, [SequenceChunk(ids[start:end], start, seq_pages, state_slot=state_slot)])
        check(out.logits[0], ref[end - 1], f"chunk {start}:{end}")
    for pos in range(ends[-1], len(ids)):
        out = step(runner, [SequenceChunk([ids[pos]], pos, seq_pages, state_slot=state_slot)])
        check(out.logits[0], ref[pos], f"decode at {pos}")


def greedy_tokens(runner: ModelRunner, prompts: list[list[int]], n: int,
                  state_slots: list[int] | None = None) -> list[list[int]]:
    """The ``n`` tokens each prompt generates greedily, in one batch fed back the runner's own tokens;
    sequence b keeps its recurrent state in ``state_slots[b]`` (no slot by default)."""
    slots = state_slots or [-1] * len(prompts)
    seq_pages = [pages(runner, len(p) + n) for p in prompts]
    out = step(runner, [SequenceChunk(p, 0, pg, state_slot=s) for p, pg, s in zip(prompts, seq_pages, slots)])
    got = [[int(t)] for t in out.next_tokens.tolist()]
    while len(got[0]) < n:
        out = step(runner, [SequenceChunk([g[-1]], len(p) + len(g) - 1, pg, state_slot=s)
                            for p, g, pg, s in zip(prompts, got, seq_pages, slots)])
        for g, t in zip(got, out.next_tokens.tolist()):
            g.append(int(t))
    return got


def check_batch_decode(runner: ModelRunner, hf: torch.nn.Module, prompts: list[list[int]], steps: int,
                       state_slots: list[int] | None = None, **hf_kwargs) -> None:
    """Prefills ``prompts`` in one batch, then decodes them greedily: before each of ``steps`` decode
    steps, every sequence's logits are within 1e-4 of transformers' (``hf`` called with ``hf_kwargs``)."""
    seqs, slots = [list(p) for p in prompts], state_slots or [-1] * len(prompts)
    seq_pages = [pages(runner, len(p) + steps) for p in seqs]
    out = runner.forward([SequenceChunk(p, 0, pg, state_slot=s) for p, pg, s in zip(seqs, seq_pages, slots)],
                         [GREEDY] * len(seqs), [0] * len(seqs))
    for i in range(steps):
        for b, p in enumerate(seqs):
            with torch.no_grad():
                ref = hf(torch.tensor([p]), **hf_kwargs).logits[0, -1]
            assert rel_err(out.logits[b], ref) < 1e-4, (i, b)
        for p, t in zip(seqs, out.next_tokens.tolist()):
            p.append(t)
        chunks = [SequenceChunk([p[-1]], len(p) - 1, pg, state_slot=s) for p, pg, s in zip(seqs, seq_pages, slots)]
        out = runner.forward(chunks, [GREEDY] * len(seqs), [i + 1] * len(seqs))


# ==== on a GPU: forwards under set_sync_debug_mode("error"), graphs against eager ====


def gpu_prefill_then_decode(r: ModelRunner, ids: list[int], split: list[int], sync_error: bool,
                            state_slot: int = -1) -> list[torch.Tensor]:
    """Logits after each prefill chunk (ending at ``split``) and each decoded token of ``ids``; with
    ``sync_error`` each forward runs under ``set_sync_debug_mode("error")``."""
    seq_pages = r.kv_pool.allocate(r.kv_pool.pages_for(len(ids)))
    out, start = [], 0
    for end in split + list(range(split[-1] + 1, len(ids) + 1)):
        torch.cuda.set_sync_debug_mode("error" if sync_error else "default")
        try:
            chunk = SequenceChunk(ids[start:end], start, seq_pages, state_slot=state_slot)
            out.append(r.forward([chunk], [GREEDY], [0]).logits[0].clone())
        finally:
            torch.cuda.set_sync_debug_mode("default")
        start = end
    r.kv_pool.free(seq_pages)
    return out


def gpu_decode_logits(r: ModelRunner, prompts: list[list[int]], steps: int,
                      state_slots: list[int] | None = None) -> torch.Tensor:
    """Prefills ``prompts`` in one batch, then decodes ``steps`` greedy tokens each: the decode steps'
    logits, stacked. Steps after the first (which captures a graph) run under sync debug "error"."""
    n, slots = len(prompts), state_slots or [-1] * len(prompts)
    seq_pages = [r.kv_pool.allocate(r.kv_pool.pages_for(len(p) + steps)) for p in prompts]
    r.forward([SequenceChunk(p, 0, pg, state_slot=s) for p, pg, s in zip(prompts, seq_pages, slots)], [GREEDY] * n,
              [0] * n)
    seqs, logits = [list(p) for p in prompts], []
    for i in range(steps):
        torch.cuda.set_sync_debug_mode("error" if i else "default")  # step 0 captures
        try:
            chunks = [SequenceChunk([s[-1]], len(s) - 1, pg, state_slot=slot)
                      for s, pg, slot in zip(seqs, seq_pages, slots)]
            out = r.forward(chunks, [GREEDY] * n, [i + 1] * n)
            logits.append(out.logits.clone())
            nxt = out.next_tokens.clone()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for s, t in zip(seqs, nxt.tolist()):
            s.append(t)
    return torch.stack(logits)


def assert_greedy_up_to_near_ties(ref: torch.Tensor, out: list[int], turn: int) -> None:
    """Asserts each token of ``out`` is the argmax of its row of ``ref`` (transformers' logits), up to
    ``NEAR_TIE``; ``turn`` names the failing turn."""
    chosen = ref.gather(1, torch.tensor(out)[:, None])[:, 0]
    gap = ref.max(-1).values - chosen
    assert (gap <= NEAR_TIE).all(), (turn, out, ref.argmax(-1).tolist(), gap.tolist())
