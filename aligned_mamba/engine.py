"""The reference sampler engine: requests scheduled through ``CausalLM.advance``.

It schedules the way serving engines do, so every case the trainer must agree with occurs:
decode steps first (one token per running request), then prefill chunks under a shared token
budget (prompts split at unaligned points, mixed with other requests' decode in one batch),
requests joining and leaving while others run, and preemption: a preempted request loses its
slot and is later recomputed from an empty slot over its whole history.

Sampling is seeded per (engine seed, request, position), so a request's tokens depend on its
logits only, never on the schedule. ``ReferenceEngine`` runs ``integrations.Scenario``s on it (the
"reference" engine of ``check`` and ``rl``).
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .contract import Contract
from .errors import AlignedMambaError
from .integrations import EngineSpec, Scenario, ScenarioResult
from .models import build_model, load_source
from .models.causal_lm import CausalLM
from .ops.step import Step

#: the default page of a paged KV cache, in tokens (a multiple of the attention key block)
PAGE_SIZE = 256


@dataclass
class Request:
    """One sequence. ``tokens`` is the known stream (prompt, then sampled tokens)."""

    req_id: int
    tokens: list[int]
    prompt_len: int
    max_new_tokens: int
    emit_all_rows: bool = False
    slot: int | None = None
    num_computed: int = 0
    preemptions: int = 0
    # (position, logits row) for every logits row the engine produced, in order.
    rows: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    # logprob of each sampled token under the row that sampled it
    sampled_logprobs: list[float] = field(default_factory=list)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def finished(self) -> bool:
        return len(self.tokens) - self.prompt_len >= self.max_new_tokens

    @property
    def pending(self) -> int:
        """Known tokens not yet fed to the model."""
        return len(self.tokens) - self.num_computed


class SamplerEngine:
    """Continuous batching over ``num_slots`` state slots with a per-step token budget."""

    def __init__(self, model: CausalLM, *, num_slots: int, max_batch_tokens: int | None = None,
                 seed: int = 0, temperature: float = 1.0, graphs: bool | None = None,
                 max_len: int | None = None, page_size: int | None = None, num_pages: int | None = None) -> None:
        if max_batch_tokens is not None and max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
        self.model = model
        triton_gpu = model.backend.name == "triton" and model.device.type == "cuda"
        # decode-only steps as CUDA graphs where the backend can capture them (default: the triton
        # backend on a GPU); the cache then holds one spare slot for the graphs' padding entries
        why = model.uncapturable
        if graphs is None:
            graphs = triton_gpu and why is None
        elif graphs and why is not None:
            raise AlignedMambaError(f"decode graphs refused: {why}, which a CUDA graph cannot capture")
        # layers that keep a row per token (attention) keep them in pages on the triton backend (handed
        # out as sequences grow, given back when they finish; a graph reads the block table on the
        # device); the torch backend keeps its slot cache unless ``page_size`` asks for pages
        if page_size is None and model.per_length_state and model.backend.name == "triton":
            page_size = max(PAGE_SIZE, model.backend.configs.attn_block_n)
        # max_len: the most tokens (prompt + generated) a request may reach, for layers that keep a
        # row per token (attention's keys and values); default the model's max_len
        self.cache = model.new_cache(num_slots + 1 if graphs else num_slots, max_len, page_size=page_size,
                                     num_pages=num_pages)
        self.graphs = None
        if graphs:
            from .decode_graph import DecodeGraphs

            self.graphs = DecodeGraphs(model, self.cache, spare_slot=num_slots)
        self.max_batch_tokens = max_batch_tokens
        self.seed = seed
        self.temperature = temperature
        self.free_slots = list(range(num_slots))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.steps = 0
        self._next_id = 0

    def add_request(self, prompt: list[int], max_new_tokens: int, *, emit_all_rows: bool = False) -> Request:
        if not prompt:
            raise ValueError("a prompt needs at least one token")
        limit = self.cache.max_len
        if limit is not None and len(prompt) + max_new_tokens > limit:
            raise ValueError(f"a request of {len(prompt)} + {max_new_tokens} tokens exceeds the cache's "
                             f"{limit} tokens per sequence")
        pages = self.cache.pages
        if pages is not None and -(-(len(prompt) + max_new_tokens) // pages.page_size) > self._pages_for_requests:
            raise ValueError(f"a request of {len(prompt)} + {max_new_tokens} tokens needs more KV pages than the "
                             f"cache's {self._pages_for_requests} of {pages.page_size} tokens")
        req = Request(self._next_id, list(prompt), len(prompt), max_new_tokens, emit_all_rows)
        self._next_id += 1
        self.waiting.append(req)
        return req

    def preempt(self, req: Request) -> None:
        """Take the request's slot away; it is recomputed from scratch when rescheduled."""
        if req not in self.running:
            raise ValueError(f"request {req.req_id} is not running")
        self.running.remove(req)
        self._free(req.slot)
        req.slot, req.num_computed = None, 0
        req.preemptions += 1
        self.waiting.appendleft(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self) -> None:
        while self.waiting and self.free_slots:
            req = self.waiting.popleft()
            req.slot = self.free_slots.pop(0)
            self.cache.reset([req.slot])
            self.running.append(req)

    def step(self) -> None:
        """Run one batch: decodes first, then prefill chunks while the budget lasts."""
        self._admit()
        budget = self.max_batch_tokens if self.max_batch_tokens is not None else 1 << 62
        plan: list[tuple[Request, int]] = []
        for req in sorted(self.running, key=lambda r: r.pending != 1):  # decodes first, stable
            if budget <= 0:
                break
            n = min(req.pending, budget)
            if n > 0:
                plan.append((req, n))
                budget -= n
        if self.cache.pages is not None:
            plan = self._fit_pages(plan)
        if not plan:
            return
        batch = Step.make([r.slot for r, _ in plan], [r.num_computed for r, _ in plan], [n for _, n in plan])
        ids, want = [], []
        for req, n in plan:
            pos = range(req.num_computed, req.num_computed + n)
            ids.extend(req.tokens[p] for p in pos)
            last = len(req.tokens) - 1
            want.extend((p == last and not req.finished) or req.emit_all_rows for p in pos)
        want_t = torch.tensor(want, dtype=torch.bool)
        ids_t = torch.tensor(ids, dtype=torch.int64)
        if self.graphs is not None and all(n == 1 for _, n in plan) and len(plan) <= self.graphs.buckets[-1]:
            logits = self.graphs.step(batch.slots, batch.start_pos, ids_t)[want_t.to(self.model.device)]
        else:
            logits = self.model.advance(self.cache, batch, ids_t, want_t)
        k = r = 0  # k indexes logits rows, r the packed token rows
        to_sample: list[tuple[Request, int, int]] = []
        for req, n in plan:
            start = req.num_computed
            req.num_computed += n
            for i in range(n):
                r += 1
                if not want[r - 1]:
                    continue
                pos = start + i
                req.rows.append((pos, logits[k]))
                if pos == len(req.tokens) - 1 and not req.finished:
                    to_sample.append((req, pos, k))
                k += 1
        if to_sample:
            self._sample(logits[[k for _, _, k in to_sample]], to_sample)
        self.steps += 1
        for req in [r for r, _ in plan if r.finished and r.pending <= 1]:
            self.running.remove(req)
            self._free(req.slot)
            req.slot = None

    @property
    def _pages_for_requests(self) -> int:
        """The KV pages requests may hold (the graphs' spare slot keeps one)."""
        return self.cache.pages.num_pages - (1 if self.graphs is not None else 0)

    def _fit_pages(self, plan: list[tuple[Request, int]]) -> list[tuple[Request, int]]:
        """The plan with the KV pages it needs: while the free pages fall short, the request admitted
        last is preempted (its pages freed, recomputed later from scratch), as serving engines do
        under KV-cache pressure. The oldest request always fits (``add_request`` checks)."""
        pages = self.cache.pages
        while True:
            need = sum(max(0, -(-(r.num_computed + n) // pages.page_size) - int(pages.held[r.slot])) for r, n in plan)
            if need <= pages.pages_free or len(self.running) <= 1:
                return plan
            victim = self.running[-1]
            if victim.num_computed == 0:  # admitted, nothing computed yet: it waits again (no preemption)
                self.running.remove(victim)
                self._free(victim.slot)
                victim.slot = None
                self.waiting.appendleft(victim)
            else:
                self.preempt(victim)
            plan = [(r, n) for r, n in plan if r is not victim]

    def _free(self, slot: int) -> None:
        """The slot goes back to the free list, its KV pages (a paged cache's) to the page pool."""
        self.free_slots.append(slot)
        if self.cache.pages is not None:
            self.cache.pages.release([slot])

    def _sample(self, rows: torch.Tensor, who: list[tuple[Request, int, int]]) -> None:
        """Sample the next token of each request from its row, seeded by (seed, request, position)."""
        if not bool(torch.isfinite(rows).all()):
            # weights that overflow (a diverged update) give NaN/inf logits: stop with the reason,
            # not with the sampler's "probability tensor contains inf, nan" from deep inside
            from .errors import RuntimeFailure

            bad = [who[i][0].req_id for i in range(rows.shape[0]) if not bool(torch.isfinite(rows[i]).all())]
            raise RuntimeFailure(f"non-finite logits at engine step {self.steps} for request(s) {bad[:4]}: the "
                                 "weights overflow the model dtype (a diverged update?)")
        # the contract's logprob, taken where the trainer takes it (the triton backend's kernel on a GPU)
        log_softmax = self.model.backend.log_softmax
        lp = log_softmax(rows).cpu()
        lp_t = lp if self.temperature == 1.0 else log_softmax(rows, self.temperature).cpu()
        probs = torch.exp(lp_t.double())
        for i, (req, pos, _) in enumerate(who):
            g = torch.Generator().manual_seed((self.seed * 1_000_003 + req.req_id * 10_007 + pos) % (1 << 62))
            tok = int(torch.multinomial(probs[i], 1, generator=g))
            req.tokens.append(tok)
            req.sampled_logprobs.append(float(lp[i, tok]))

    def run(self) -> None:
        while self.has_work():
            self.step()


class ReferenceEngine:
    """The built-in engine (``integrations.Engine``): ``SamplerEngine`` over the core's model, one
    slot per request. ``exact_replay=False`` in the spec decodes as engines do today
    (``baseline.baseline_model``)."""

    def __init__(self, spec: EngineSpec, model: CausalLM | None = None) -> None:
        self.spec = spec
        self.contract = Contract.from_dict(spec.contract)
        if model is None:
            self.config, tensors = load_source(spec.model, spec.dtype)
            model = build_model(self.config, tensors, self.contract)
        else:
            self.config = model.config
        self.model = self._wrap(model)

    @classmethod
    def for_model(cls, model: CausalLM, *, exact_replay: bool = True) -> ReferenceEngine:
        """An engine over a model already built (tests, benchmarks)."""
        return cls(EngineSpec(model="<memory>", contract=model.contract.to_dict(), exact_replay=exact_replay), model)

    def _wrap(self, model: CausalLM) -> CausalLM:
        if self.spec.exact_replay:
            return model
        from .baseline import baseline_model

        return baseline_model(model)

    def _build(self, tensors: dict[str, torch.Tensor]) -> CausalLM:
        return self._wrap(build_model(self.config, tensors, self.contract))

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        self.model = self._build(tensors)

    def run(self, scenario: Scenario, on_step: Callable[[int], None] | None = None) -> ScenarioResult:
        """All requests through one ``SamplerEngine``: every prompt at once (or one after another with
        ``stagger``), the scenario's budget per step, a request preempted when it reaches each mark."""
        sc = scenario
        t0 = time.perf_counter()
        # the baseline's recurrent scan indexes its state from the host: it is not captured in graphs
        engine = SamplerEngine(self.model, num_slots=len(sc.prompts), max_batch_tokens=sc.budget, seed=sc.seed,
                               graphs=None if self.spec.exact_replay else False,
                               max_len=max(len(p) for p in sc.prompts) + sc.gen_len)
        all_rows = sc.rows == "all"
        pending = list(sc.prompts)
        reqs: list[Request] = []
        if not sc.stagger:
            reqs = [engine.add_request(p, sc.gen_len, emit_all_rows=all_rows) for p in pending]
            pending = []
        every = max(1, sc.gen_len // (len(sc.prompts) + 1))
        done_marks: dict[int, set[int]] = {}
        loop = 0  # loop turns (an engine step with nothing to run is not an engine step)
        while pending or engine.has_work():
            if pending and loop % every == 0:
                reqs.append(engine.add_request(pending.pop(0), sc.gen_len, emit_all_rows=all_rows))
            engine.step()
            loop += 1
            if on_step is not None:
                on_step(engine.steps)
            for req in list(engine.running):
                seen = done_marks.setdefault(req.req_id, set())
                for m in sc.preempt_marks:
                    if len(req.generated) >= m and m not in seen and not req.finished:
                        seen.add(m)
                        engine.preempt(req)
                        break
        rows = [] if sc.rows == "none" else [[(pos, row.cpu()) for pos, row in r.rows] for r in reqs]
        return ScenarioResult(sc.name, [list(r.tokens) for r in reqs], rows, [list(r.sampled_logprobs) for r in reqs],
                              engine.steps, sum(r.preemptions for r in reqs), time.perf_counter() - t0, os.getpid(),
                              {"engine": "reference", "exact_replay": self.spec.exact_replay})

    def close(self) -> None:
        self.model = None  # type: ignore[assignment]


def make_engine(spec: EngineSpec) -> ReferenceEngine:
    """The "reference" engine's factory (``integrations.engine_factory``); ``spec.tp`` > 1 gives its
    tensor-parallel form (``tp_reference.TPReferenceEngine``: the ranks as gloo processes)."""
    if spec.tp > 1:
        from .tp_reference import TPReferenceEngine

        return TPReferenceEngine(spec)  # type: ignore[return-value]
    return ReferenceEngine(spec)


make_engine.per_scenario = True  # type: ignore[attr-defined]  # a model build is cheap: one worker per scenario
