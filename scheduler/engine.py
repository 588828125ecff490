"""The scheduler's engine: admission, continuous batching with chunked prefill, and the overlap
loop, without any sockets (the server drives it; tests drive it directly).

One call of ``step``:
  1. admit waiting requests while KV pages (for what they prefill, plus a page of growth per
     running request) and token-buffer rows allow;
  2. launch the next batch: decode tokens of running requests plus prefill chunks within the
     prefill token budget; decode inputs come from the device token buffer, never the host; a
     decode takes a KV page when its sequence crosses into one, and when none is left the newest
     requests are preempted (pages to the prefix cache, queued again to prefill what they had); a
     request whose prefix the KV tier is still copying in waits (polled) while others run, and
     when nothing else runs it goes behind a wait for the copies on the compute stream;
  3. read back the previous step's sampled tokens (pinned copy + event, one step late);
  4. turn them into updates, finish requests, and release their pages.

Constrained requests (``scheduler.grammar``) need their previous token before their next token
is drawn (their mask follows from it), not before their next forward: a step with constrained rows
launches its forward first, then reads back the step in flight, fills the constrained rows' masks
from the tokens just read, and launches its sampling; the host's reading and the mask building run
while the GPU computes the forward. Unconstrained requests take part in every step.

A step that raises fails the requests in it (``failures`` lists them; their pages go back, none to
the prefix cache) and the engine goes on; an error that poisons the device is raised.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import NamedTuple

import torch

from scheduler.config import EngineConfig
from scheduler.faults import FaultHooks, poisons_device
from scheduler.grammar import HostMask, library_failure, one_line
from scheduler.messages.from_scheduler import TokenUpdate
from scheduler.page_manager import PageManager
from scheduler.request import Request
from scheduler.state_cache import PENDING_PREFILL
from worker.batch import SequenceChunk, to_device
from worker.memory_plan import MemoryPlan
from worker.runner import ModelRunner
from worker.token_mask import TokenMask

log = logging.getLogger("sluice.scheduler")


class _Launched(NamedTuple):
    reqs: list[Request]
    samples: list[bool]  # the entry's sampled token is an output token (not a mid-prompt chunk)
    tokens: torch.Tensor  # [B] on the host (pinned on CUDA), valid once ``event`` completes
    event: torch.cuda.Event | None
    masked: bool = False  # carries a grammar mask: the next masked step reads it back before it samples


class Failure(NamedTuple):
    rid: str
    message: str
    internal: bool = True  # False: the request's own grammar failed it (its client gets a bad-request error)


class Engine:
    def __init__(self, runner: ModelRunner, config: EngineConfig = EngineConfig(),
                 faults: FaultHooks = FaultHooks([]), plan: MemoryPlan | None = None):
        """``plan``: the memory plan the engine sizes its prefill chunk and host KV tier from; None:
        the runner's (a benchmark's A/B passes it with the tier or the chunk changed)."""
        self.runner = runner
        self.config = config
        self.faults = faults
        plan = plan or runner.plan
        self.prefill_tokens = plan.prefill_tokens
        self.failures: list[Failure] = []  # requests a step failed since the caller last took them
        self._launching: list[Request] = []  # the batch being prepared or launched
        self._read_early: list[TokenUpdate] = []  # this step's updates read before it sampled (grammars)
        self.states = runner.state_pool  # hybrid models: a recurrent-state slot per token-buffer row
        if self.states is not None and config.max_running > self.states.running:
            raise ValueError(f"--max-running {config.max_running} exceeds the model's {self.states.running} "
                             f"recurrent-state slots")
        self.pages = PageManager(runner.kv_pool, config.prefix_cache, plan.host_kv_bytes, config.kv_tier_mode,
                                 config.kv_tier_copy, self.states, runner.window_pool,
                                 runner.model_config.sliding_window)
        self.device = runner.device
        self.token_buffer = torch.zeros(config.max_running, dtype=torch.int64, device=self.device)
        self.free_rows = list(range(config.max_running - 1, -1, -1))
        self.mask = HostMask(config.max_running, runner.model_config.vocab_size, self.device)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.in_flight: _Launched | None = None
        self.preempted: list[Request] = []  # gave their pages back this step; queued again after it
        self.counters = dict(requests_finished=0, requests_aborted=0, requests_preempted=0, prompt_tokens=0,
                             generated_tokens=0, cached_prompt_tokens=0, steps=0, requests_failed=0)
        self.started = time.monotonic()
        # wall seconds in step(), and of them waiting for a step's tokens: under overlap scheduling
        # the rest is host work the GPU runs beside, so a wait near zero says the host bounds the loop;
        # and enqueueing steps that carry a prefill chunk (host work before a turn's first token)
        self.seconds = dict(engine_step_s=0.0, engine_gpu_wait_s=0.0, engine_prefill_launch_s=0.0)

    # ==== requests ====

    def submit(self, req: Request) -> str | None:
        """Queue ``req``; returns an error message instead when it can never run."""
        ctx = self.runner.model_config.max_context
        if len(req.prompt) + req.max_tokens > ctx:
            return f"prompt ({len(req.prompt)} tokens) + max_tokens ({req.max_tokens}) exceeds the context of {ctx}"
        if self.pages.pages_needed(req) > self.pages.pool.capacity:  # alone it could never finish
            return (f"prompt ({len(req.prompt)} tokens) + max_tokens ({req.max_tokens}) needs more KV pages "
                    f"than the pool holds ({self.pages.pool.capacity} pages of {self.pages.page_size})")
        self.waiting.append(req)
        return None

    def abort(self, rid: str) -> bool:
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                self.counters["requests_aborted"] += 1
                return True
        for req in self.running:
            if req.rid == rid:
                self._finish(req)
                self.counters["requests_aborted"] += 1
                return True
        return False

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.in_flight)

    def check_pages(self) -> None:
        self.pages.check(self.running)

    # ==== the loop ====

    def step(self) -> list[TokenUpdate]:
        previous = self.in_flight.reqs if self.in_flight else []
        self._launching, self._read_early = [], []
        started = time.perf_counter()
        try:
            return self._step()
        except Exception as exc:
            if poisons_device(exc):
                raise
            in_step = previous + self._launching + (self.in_flight.reqs if self.in_flight else [])
            self.in_flight, self._launching = None, []
            self._contain(exc, in_step)
            self._requeue_preempted()
            return self._read_early  # read before the failure: a request they finished is told so
        finally:
            self.seconds["engine_step_s"] += time.perf_counter() - started

    def take_failures(self) -> list[Failure]:
        failures, self.failures = self.failures, []
        return failures

    def _contain(self, exc: Exception, reqs: list[Request]) -> None:
        """Fail ``reqs`` (a step raised ``exc`` while they were in it) and free what they hold."""
        reqs = list({id(r): r for r in reqs if not r.finished}.values())  # a request may be in two batches
        names = ", ".join(r.rid for r in reqs)
        log.error("a step failed (requests %s); failing them and serving on", names, exc_info=exc)
        for req in reqs:
            self._fail(req, f"internal error in the scheduler: {type(exc).__name__}: {exc}")

    def _drop_failed(self, req: Request) -> None:
        # Its KV may be half written: nothing of it goes to the prefix cache.
        req.finished = True
        if req in self.waiting:
            self.waiting.remove(req)
        elif req.preempted:
            self.preempted.remove(req)
        elif req in self.running:
            self.running.remove(req)
            self.pages.release(req, [])
            self.free_rows.append(req.slot)

    def _step(self) -> list[TokenUpdate]:
        self._admit()
        launched = self._launch()
        if not self.config.overlap and launched is not None:
            launched, self.in_flight = None, launched
        previous, self.in_flight = self.in_flight, launched
        updates = self._read_early + (self._process(previous) if previous else [])
        self._requeue_preempted()
        return updates

    def _read_masked(self) -> None:
        """Read the in-flight step back now when it carries a grammar mask: the constrained
        requests of the step being launched need its tokens for their masks (and its mask's copy
        must be done before the host rows are written again)."""
        if self.in_flight is not None and self.in_flight.masked:
            previous, self.in_flight = self.in_flight, None
            self._read_early = self._process(previous)

    def _admit(self) -> None:
        while self.waiting and self.free_rows and len(self.running) < self.config.max_running:
            req = self.waiting[0]
            # keep a page per running request for its next decode, so admitting rarely forces a preemption
            if not self.pages.admit(req, reserve=len(self.running)):
                break
            self.waiting.popleft()
            req.slot = self.free_rows.pop()
            if self.states is not None:
                self.pages.resume_state(req, self.states.running_slot(req.slot))
            self.running.append(req)
            if not req.preemptions:
                self.counters["cached_prompt_tokens"] += req.cached_tokens

    def _launch(self) -> _Launched | None:
        reqs, chunks, params, steps, samples = self._plan()
        if not chunks:
            return self._launch_after_copies()
        rows = [r.slot if s and r.grammar is not None else -1 for r, s in zip(reqs, samples)]
        mask = TokenMask(self.mask.device_words, rows) if max(rows) >= 0 else None
        enqueueing = time.perf_counter()
        step = self.runner.launch(chunks, params, steps, self.token_buffer, mask)
        if any(c.buffer_slot < 0 for c in chunks):  # prompt tokens from the host: a prefill chunk
            self.seconds["engine_prefill_launch_s"] += time.perf_counter() - enqueueing
        self.pages.launched()
        if self.pages.states is not None:
            self._take_snapshots(reqs, chunks)
        if mask is not None:
            self._read_masked()
            self._fill_mask(reqs, rows)
        out = self.runner.sample(step)
        (slots,) = to_device([[r.slot for r in reqs]], self.device)
        self.token_buffer.index_copy_(0, slots, out.next_tokens)
        self.counters["steps"] += 1
        if self.device.type != "cuda":  # a copy: a static decode step's outputs are views the next step overwrites
            return _Launched(reqs, samples, out.next_tokens.clone(), None, mask is not None)
        host = torch.empty(len(reqs), dtype=torch.int64, pin_memory=True)
        host.copy_(out.next_tokens, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return _Launched(reqs, samples, host, event, mask is not None)

    def _plan(self) -> tuple[list[Request], list[SequenceChunk], list, list[int], list[bool]]:
        """The step's requests, their chunks, sampling parameters, draw indices, and whether each
        samples an output token (a prefill chunk before the prompt's end does not)."""
        chunks, params, steps, samples = [], [], [], []
        reqs = self._launching = []
        budget = self.prefill_tokens
        for req in list(self.running):  # a preemption takes requests out
            if req.preempted:
                continue
            try:  # a failure here is this request's alone
                if not req.prefill_done:
                    self.faults.on_prepare(req.prompt)
                chunk = self._chunk_for(req, budget)
            except Exception as exc:
                if poisons_device(exc):
                    raise
                self._contain(exc, [req])
                continue
            if chunk is None:
                continue
            chunks.append(chunk)
            if chunk.buffer_slot < 0:
                budget -= len(chunk.token_ids)
            reqs.append(req)
            params.append(req.sampling)
            steps.append(req.launched_outputs)
            samples.append(req.prefill_done)
            req.launched_outputs += req.prefill_done
        return reqs, chunks, params, steps, samples

    def _fill_mask(self, reqs: list[Request], rows: list[int]) -> None:
        """Fill the mask rows of the launched step's constrained requests from their grammars (the
        tokens before are read) and copy them to the device. A request that finished meanwhile, or
        whose grammar allows no token (it fails), gets a row allowing every token: its draw is
        dropped, and a well-formed row keeps the sampler's input ordinary."""
        live = [(r, row) for r, row in zip(reqs, rows) if row >= 0 and not r.finished]
        empty = self.mask.fill([(r.grammar, row) for r, row in live]) if live else {}
        for req, row in live:
            if row in empty:  # llguidance's error (a panic), the matcher's reason when it stopped (a step limit)
                error = empty[row] or (req.grammar.get_error() if req.grammar.is_error() else "")
                reason = error.splitlines()[0] if error else "the grammar allows no next token (an unsatisfiable schema?)"
                self._fail(req, f"{reason} (after {len(req.output)} tokens)", internal=False)
        self.mask.allow_all([row for r, row in zip(reqs, rows) if row >= 0 and r.finished])
        self.mask.to_device()

    def _fail(self, req: Request, message: str, internal: bool = True) -> None:
        self._drop_failed(req)
        self.failures.append(Failure(req.rid, message, internal))
        self.counters["requests_failed"] += 1

    def _chunk_for(self, req: Request, budget: int) -> SequenceChunk | None:
        """``req``'s share of the step being launched: a decode token, a prefill chunk within
        ``budget`` tokens, or None (it waits)."""
        state = self.states.running_slot(req.slot) if self.states is not None else -1
        if req.wants_decode:
            pos = len(req.prompt) + req.launched_outputs - 1
            if not self._page_for(req, pos):
                return None
            return SequenceChunk([0], pos, req.pages, buffer_slot=req.slot, state_slot=state,
                                 window_pages=self.pages.window_table(req, pos, pos + 1))
        if req.prefill_done or budget <= 0 or not self._kv_ready(req):
            return None
        n = min(budget, req.prefill_len - req.prefilled)
        chunk = SequenceChunk(req.prefill_tokens[req.prefilled:req.prefilled + n], req.prefilled, req.pages,
                              state_slot=state, window_pages=self.pages.window_table(req, req.prefilled,
                                                                                     req.prefilled + n),
                              state_snapshot=self._prompt_snapshot(req, n))
        req.prefilled += n
        return chunk

    def _prompt_snapshot(self, req: Request, n: int) -> tuple[int, int] | None:
        """Hybrid models: where the prompt's last page boundary falls inside ``req``'s next chunk of
        ``n`` tokens, the chunk's linear layers write their state there into a fresh snapshot slot
        (``SequenceChunk.state_snapshot``), so the prompt takes one forward, not two. A chunk that
        ends on the boundary is snapshotted after it (``_take_snapshots``)."""
        if self.pages.states is None:
            return None
        boundary = (req.prefill_len - 1) // self.pages.page_size * self.pages.page_size
        if not req.prefilled < boundary < req.prefilled + n:
            return None
        slot = self.pages.states.reserve()
        if slot is None:
            return None
        req.snapshots.append((boundary, slot))
        return boundary - req.prefilled, slot

    def _take_snapshots(self, reqs: list[Request], chunks: list[SequenceChunk]) -> None:
        """Snapshot the state of each request whose step ended on a page boundary (hybrid models):
        the latest few prefill chunk ends, and in decode the latest boundary, one slot rewritten."""
        P, cache = self.pages.page_size, self.pages.states
        for req, chunk in zip(reqs, chunks):
            end = chunk.prefix_len + len(chunk.token_ids)
            if end % P:
                continue
            if chunk.buffer_slot >= 0 and req.snapshots and req.snapshots[-1][0] > len(req.prompt):
                cache.retake(req.snapshots[-1][1], chunk.state_slot)
                req.snapshots[-1] = (end, req.snapshots[-1][1])
                continue
            slot = cache.take(chunk.state_slot)
            if slot is None:
                continue
            req.snapshots.append((end, slot))
            if chunk.buffer_slot < 0 and len(req.snapshots) > PENDING_PREFILL:
                cache.release([req.snapshots.pop(0)[1]])

    def _page_for(self, req: Request, position: int) -> bool:
        """A KV page for ``req``'s next decode; when none is left, the newest requests give theirs
        back (to the prefix cache) until one is, ``req`` itself last (False: it waits)."""
        while not self.pages.grow(req, position):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        """Release ``req``'s pages and row; its token still in flight (if any) arrives this step,
        then it queues again at the front, to prefill its tokens anew (mostly prefix-cache hits)."""
        self.pages.release(req, req.kv_tokens)
        self.running.remove(req)
        self.free_rows.append(req.slot)
        req.preempted = True
        req.preemptions += 1
        self.preempted.append(req)
        self.counters["requests_preempted"] += 1

    def _requeue_preempted(self) -> None:
        for req in reversed(self.preempted):
            if not req.finished:
                req.requeue()
                self.waiting.appendleft(req)
        self.preempted.clear()

    @staticmethod
    def _kv_ready(req: Request) -> bool:
        """Whether the page copies ``req`` waits for (a restored prefix) are done; never waits."""
        if req.kv_ready is not None and not req.kv_ready.query():
            return False
        req.kv_ready = None
        return True

    def _launch_after_copies(self) -> _Launched | None:
        """Nothing could launch and no step is in flight: the requests waiting for page copies go
        now, behind a wait for the copies on the compute stream (the GPU waits, not the host, which
        goes on enqueueing the chunk). The newest event covers every copy: they share one stream."""
        waiting = [r for r in self.running if r.kv_ready is not None]
        if not waiting or self.in_flight is not None:
            return None
        waiting[-1].kv_ready.wait()
        for req in waiting:
            req.kv_ready = None
        return self._launch()

    def _process(self, launched: _Launched) -> list[TokenUpdate]:
        if launched.event is not None:
            waiting = time.perf_counter()
            launched.event.synchronize()  # the one planned read: tokens of the step before
            self.seconds["engine_gpu_wait_s"] += time.perf_counter() - waiting
        updates = []
        for req, sampled, token in zip(launched.reqs, launched.samples, launched.tokens.tolist()):
            if not sampled or req.finished:
                continue
            try:  # the matcher consumes the token: llguidance may raise, a Rust panic too (a BaseException)
                accepted = req.accept(token)
            except BaseException as exc:
                if not library_failure(exc):
                    raise
                self._fail(req, f"the grammar failed on sampled token {token}: {one_line(exc)}", internal=False)
                continue
            if not accepted:
                error = req.grammar.get_error().partition("\n")[0]  # not the parser state dumped after it
                self._fail(req, f"the grammar refused sampled token {token}: {error}", internal=False)
                continue
            self.counters["generated_tokens"] += 1
            reason = req.finish_reason()
            first = not req.sent_first
            req.sent_first = True
            updates.append(TokenUpdate(rid=req.rid, token_ids=[token], finished=reason is not None,
                                       finish_reason=reason, prompt_tokens=len(req.prompt),
                                       cached_prompt_tokens=req.cached_tokens))
            if first:
                self.counters["prompt_tokens"] += len(req.prompt)
            if reason:
                self._finish(req)
                self.counters["requests_finished"] += 1
        return updates

    def _finish(self, req: Request) -> None:
        """Done or aborted: the pages of its written KV go to the prefix cache (a preempted one's
        already went, with its row)."""
        req.finished = True
        if req.preempted:
            self.preempted.remove(req)
            return
        self.running.remove(req)
        self.pages.release(req, req.kv_tokens)
        self.free_rows.append(req.slot)

    # ==== stats ====

    def stats(self) -> dict[str, int | float | str]:
        pool = self.pages.pool
        elapsed = max(time.monotonic() - self.started, 1e-9)
        radix = self.pages.radix
        return {
            **self.counters,
            **self.seconds,
            "engine_host_s": self.seconds["engine_step_s"] - self.seconds["engine_gpu_wait_s"],
            "requests_running": len(self.running),
            "requests_waiting": len(self.waiting),
            "generated_tokens_per_s": self.counters["generated_tokens"] / elapsed,
            "kv_pages_total": pool.capacity,
            "kv_pages_free": pool.num_free,
            "kv_pages_cached": radix.num_pages if radix else 0,
            "kv_usage": 1 - pool.num_free / pool.capacity,
            **self.pages.stats(),
            **self.runner.stats(),
        }
