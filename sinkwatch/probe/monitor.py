"""Monitor: probe sets x capture x metrics -> Snapshot (docs/design.md §1).

The same ``Monitor.probe(model)`` serves the callbacks, replay and the one-shot CLI, so a number
computed live at step N equals the one replay computes on the checkpoint saved at step N.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
import warnings
from collections.abc import Iterable, Sequence

import numpy as np
import torch
from torch import nn

from .. import metrics, stages
from ..capture import ProbeTarget, resolve_target, untouched
from ..kernels import resolve_backend
from ..kernels.api import prepare_backend
from ..probes import InductionProbe, NaturalProbe, ProbeRecipe, ProbeSet, RepeatedRandomProbe
from ..records import device_of, versions
from ..stages import classify
from .collectors import AblationPart, HeadCountPart, ProbeCollector
from .config import PROTOCOLS, MonitorConfig  # noqa: F401 - sinkwatch.monitor's PROTOCOLS, kept
from .memory import micro_batch_rows
from .runs import P0_CIRCUIT_KEYS, PROBE_RUNS, ProbeRun, SinkRun, anchor_view, bos_free_twin
from .share import ProbeShare, State, combine, micro_batches
from .snapshot import Snapshot


class Monitor:
    """Runs fixed probe sets through a model and computes every metric of docs/design.md §5.

    probes: recipes (``InductionProbe()``, ``RepeatedRandomProbe()``, ``NaturalProbe(...)``) built
    for the model's vocabulary on first use, or ready ``ProbeSet``s. At most one of each kind.
    """

    def __init__(self, probes: Sequence[ProbeRecipe | ProbeSet] = (InductionProbe(),), *, config: MonitorConfig | None = None):
        self.config = config or MonitorConfig()
        if not probes:
            raise ValueError("Monitor needs at least one probe (InductionProbe(), RepeatedRandomProbe() or NaturalProbe(...))")
        kinds = [p.kind for p in probes]
        if len(set(kinds)) != len(kinds):
            raise ValueError(f"one probe of each kind at most, got {kinds}")
        for p in probes:
            if not isinstance(p, (ProbeSet, InductionProbe, RepeatedRandomProbe, NaturalProbe)):
                raise TypeError(f"probes must be probe recipes or ProbeSets, got {type(p).__name__}")
        order = {"natural": 0, "induction": 1, "repeated": 2}
        self.probes = sorted(probes, key=lambda p: order[p.kind])
        self._built: dict[int, list[ProbeSet]] = {}

    # ---- probe sets ----
    def probe_sets(self, vocab_size: int) -> list[ProbeSet]:
        """The frozen probe sets for a vocabulary (built once, then reused every probe)."""
        if vocab_size not in self._built:
            sets = [p if isinstance(p, ProbeSet) else p.build(vocab_size) for p in self.probes]
            for s in sets:
                s.check_vocab(vocab_size)
            self._built[vocab_size] = sets
        return self._built[vocab_size]

    def probe_hashes(self, vocab_size: int) -> dict[str, str]:
        return {s.kind: s.hash for s in self.probe_sets(vocab_size)}

    def config_hash(self, vocab_size: int) -> str:
        """12 hex digits naming what makes records comparable: the probe sets' hashes, the stage
        thresholds and the metric settings (K, epsilon)."""
        payload = {
            "probes": dict(sorted(self.probe_hashes(vocab_size).items())),
            "stages": self.config.stages.to_dict(),
            "n_first": self.config.n_first,
            "sink_epsilon": self.config.sink_epsilon,
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:12]

    # ---- probing ----
    def probe(
        self,
        model: nn.Module | ProbeTarget,
        *,
        step: int | None = None,
        tokens: int | None = None,
        revision: str | None = None,
        model_name: str | None = None,
        share: ProbeShare | None = None,
    ) -> Snapshot:
        """Probe ``model`` (left exactly as found) and return its Snapshot.

        ``model``: a transformers model or anything holding one (LightningModule, PEFT, compiled,
        DDP), a module with ``sinkwatch_target()``, or a ``CustomTarget``. The record's ``*_now`` keys
        (and ``p0_stage_by_anchor``) are the stage rules applied to this probe alone; a run's history
        (``p0_stage``, ``induction_state``, ``stages_visited``, events) is a ``StageTracker``'s, kept by whoever tracks a run (the live
        monitor, replay).

        ``share``: under data parallelism, this rank's share of the sequences (``sinkwatch.probe.share``):
        every rank of the share must call ``probe`` together; each runs its sequences, one all-reduce
        combines what they kept, and every rank returns the Snapshot one process would have.
        """
        target = resolve_target(model)
        # the Triton kernels checked before any forward: one backend for the whole probe, on every rank
        prepare_backend(self.config.backend, target.device, _float_dtype(target.module), share.all_reduce if share else None)
        sets = self.probe_sets(target.vocab_size)
        for s in sets:
            if target.context is not None and s.seq_len > target.context:
                raise ValueError(
                    f"the {s.kind} probe has {s.seq_len} tokens but {target.name} has a context of {target.context}; "
                    f"use a shorter probe (--seq-len <= {target.context})"
                )
        t0 = time.perf_counter()
        # Sink keys come from the natural probe when there is one (docs/design.md §10): natural text is what the
        # model trains on, so its sinks are the ones training forms; the synthetic induction probe
        # has no BOS and random tokens, and stands in only when no natural text is configured.
        sink_source = "natural" if any(s.kind == "natural" for s in sets) else "induction"
        plan = [(s, s.kind == sink_source) for s in sets]
        natural = next((s for s in sets if s.kind == "natural"), None)
        twin = bos_free_twin(natural) if natural is not None else None
        if twin is not None:
            plan.append((twin, True))
        with untouched(target.module):
            forwarded = [self._forward(target, s, with_sinks=w, share=share) for s, w in plan]
        states = self._combine(forwarded, share)
        values: dict = {}
        outs = []
        n_heads = None
        for (runs, softmax, *_), state in zip(forwarded, states):
            out: dict = {"softmax_layers": softmax}
            for run, st in zip(runs, state):
                got, heads = run.values(st, softmax)
                out.update(got)
                n_heads = heads if heads is not None else n_heads
            outs.append(out)
        for out in outs[: len(sets)]:  # the twin's values go only where ``_p0_anchor`` puts them
            values.update(out)
        if natural is not None:
            values["bos_token_id"] = natural.params.get("bos_token_id")  # the BOS every window starts with, or None (docs/design.md §3)
            fed = outs[sets.index(natural)]
            values.update(self._p0_anchor(natural, fed, outs[-1] if twin is not None else None))
        if share is not None:
            values["probe_split"] = {"ranks": share.size, "sequences": {s.kind: s.n for s in sets}}
            if share.heads[1] > 1:
                values["tensor_parallel"] = share.heads[1]  # the heads were computed on that many ranks, gathered in global order
        values["probe_seconds"] = time.perf_counter() - t0
        values["protocol"] = self.config.protocol  # which precision/PR choices made these numbers (docs/design.md §8)
        values["stats_backend"] = resolve_backend(self.config.backend, target.device)  # provenance
        values["versions"] = versions()  # sinkwatch / torch / transformers (docs/design.md §10: every record)
        values["device"] = device_of(target.module)  # where the weights sat: cpu, cuda:0 (NVIDIA H200), ...
        snap = Snapshot(
            model=model_name or target.name,
            n_layers=target.n_layers,
            n_heads=n_heads,
            probe_hashes={s.kind: s.hash for s in sets},
            values=values,
            revision=revision,
            step=step,
            tokens=tokens,
        )
        record = snap.to_record()
        snap.values.update(classify(record, self.config.stages))  # this probe alone; a run's stages are a StageTracker's
        return snap

    def _p0_anchor(self, natural: ProbeSet, fed: dict, twin: dict | None) -> dict:
        """The anchor and circuit keys when every natural window starts with the same token (a BOS).

        The windows as fed sink on the BOS; their BOS-free twin (the same windows without their first
        token, ``twin``: its values) sinks on position 0, if anywhere. Each anchor is judged on its
        own windows (docs/stages.md, "Two anchors"): the BOS by its amplification (its own R, no
        direction test: one shared token has one direction by construction), position 0 by the
        positional rule. The sinks use the BOS's circuit unless the twin's is shallower:
        ``p0_anchor`` names the one that decides, and the record's circuit keys are its (with no
        circuit at all, the windows as fed). ``p0_anchor_views`` keeps both anchors' numbers (sinks
        included: the twin's sink rate and profile, and per head ``sink_alpha`` on the BOS vs on
        position 0), ``p0_norm_ratio_bos`` / ``circuit_layer_bos`` / ``circuit_layer_twin`` the two
        verdicts; the record's sink keys stay those of the windows as fed."""
        if twin is None:
            return {}  # the windows themselves decide (``_p0_values`` set p0_anchor)
        st = self.config.stages
        if not bool((natural.tokens[:, 1] != natural.tokens[0, 1]).any()):
            warnings.warn(
                "sinkwatch: every natural window starts with the same two tokens; whether a positional P0 circuit exists "
                "is undecidable: use natural windows from varied text",
                RuntimeWarning,
                stacklevel=3,
            )
        views = {"bos": anchor_view(fed), "position": anchor_view(twin)}
        views["bos"].update(stages.circuit(views["bos"], st, bos=True))
        views["bos"]["circuit_layer_first"] = metrics.circuit_layer(fed["p0_norm_ratio"], None, st.bos_min_norm_ratio)
        bos_layer, twin_layer = views["bos"]["circuit_layer"], views["position"]["circuit_layer"]
        if bos_layer is not None and (twin_layer is None or twin_layer >= bos_layer):
            anchor = "bos"
        else:
            anchor = "position" if twin_layer is not None else None
        chosen = views[anchor or "bos"]
        both = {"p0_norm_ratio_bos": fed["p0_norm_ratio"], "circuit_layer_bos": bos_layer, "circuit_layer_twin": twin_layer}
        return {**both, **{k: chosen[k] for k in P0_CIRCUIT_KEYS}, "p0_anchor": anchor, "p0_anchor_views": views}

    def _micro(self, probe: ProbeSet) -> int:
        return micro_batch_rows(probe.seq_len, self.config.batch_tokens)  # the rule the memory check assumes

    def _batches(self, probe: ProbeSet) -> Iterable[slice]:
        for batch, _ in micro_batches(probe.n, self._micro(probe), None):
            yield batch

    def _forward(self, target: ProbeTarget, probe: ProbeSet, *, with_sinks: bool, share: ProbeShare | None):
        """One probe set through the model: this rank's sequences (all of them without ``share``),
        then the padding forwards that give every rank of the share the same count. Returns (the
        runs, the blocks that ran softmax attention, the runs' padding template or None).

        The sink/P0 parts ride on the one probe set ``Monitor.probe`` chose for them; the kind's own
        parts and values come from ``PROBE_RUNS`` (one entry per probe kind, no branching here)."""
        L = target.n_layers
        device = target.device

        def make_runs() -> list[ProbeRun]:
            runs: list[ProbeRun] = [SinkRun(probe, L, self.config)] if with_sinks else []
            return runs + [PROBE_RUNS[probe.kind](probe, L, self.config)]

        runs, padding = make_runs(), None
        token_losses = any(run.token_losses for run in runs)
        own_parts, spare_parts = [part for run in runs for part in run.parts], []
        collector = ProbeCollector(own_parts)
        with target.capture(collector) as forward:
            for batch, real in micro_batches(probe.n, self._micro(probe), share):
                if not real and padding is None:  # throw-away runs: a rank with no sequence of its own still learns the layout
                    padding = make_runs()
                    spare_parts = [part for run in padding for part in run.parts]
                collector.parts, collector.batch = (own_parts if real else spare_parts), batch
                ids = probe.tokens[batch].to(device)
                out = forward(ids, token_losses=token_losses)  # last-position logits (+ every position's loss)
                for run in runs if real else padding:
                    run.observe(batch, ids, out)
        # blocks that ran softmax attention; the others (Mamba, linear attention) are NaN rows in
        # every attention-derived array, and counts and fractions are over these blocks' heads only
        return runs, collector.softmax_layers, padding

    def _combine(self, forwarded: list, share: ProbeShare | None) -> list[list[State]]:
        """Each run's state over the whole probe: as kept (one process), or every rank's share
        combined by one all-reduce (``probe_share.combine``)."""
        if share is None:
            return [[run.state() for run in runs] for runs, *_ in forwarded]
        flat = []
        for runs, _, padding in forwarded:
            n = runs[0].probe.n
            start, stop = share.bounds(n)
            source = runs if stop > start else padding  # padding: the same runs, built alike
            flat.extend((run.state(), run.SUMS, n, (start, stop), stop > start, run.HEADS) for run in source)
        combined = iter(combine(flat, share))
        return [[next(combined) for _ in runs] for runs, *_ in forwarded]

    # ---- group ablation ----
    def ablate(
        self,
        model: nn.Module | ProbeTarget,
        heads: Iterable[str | tuple[int, int]],
        *,
        seed: int = 123,
        control: Iterable[str | tuple[int, int]] | None = None,
    ) -> dict:
        """Group ablation on the induction probe (docs/design.md §5).

        Zeroes the given heads' slices before the output projection and scores the target B at the
        query row (valid sequences): loss, top-1, top-5 for ``baseline``, ``ablated`` and a matched
        random ``control`` (same number of heads per layer, disjoint, RandomState(seed)).

        ``control``: an explicit control set instead of the draw — the paper's sweep draws its controls
        from one shared stream (``metrics.paper_control_sets``), which one call cannot know; it must
        exist and be disjoint from ``heads``.
        """
        target = resolve_target(model)
        probe = next((s for s in self.probe_sets(target.vocab_size) if s.kind == "induction"), None)
        if probe is None:
            raise ValueError("group ablation scores the induction probe's target; configure Monitor with InductionProbe()")
        pairs = [_parse_head(h) for h in heads]
        L = target.n_layers
        H, softmax = self._n_query_heads(target, probe)
        for l, h in pairs:
            if not (0 <= l < L and 0 <= h < H):
                raise ValueError(f"head L{l}H{h} does not exist in a model with {L} layers x {H} heads")
            if l not in softmax:  # hybrid stacks: zeroing a head there would silently change nothing
                raise ValueError(f"block {l} has no softmax attention (softmax blocks: {softmax}); L{l}H{h} has no head to ablate")
        if control is None:
            short = "min" if self.config.protocol == "paper" else "raise"
            control = metrics.matched_random_heads(pairs, H, seed=seed, short_layer=short)
        else:
            control = sorted({_parse_head(h) for h in control})
            for l, h in control:
                if not (0 <= l < L and 0 <= h < H):
                    raise ValueError(f"control head L{l}H{h} does not exist in a model with {L} layers x {H} heads")
            shared = sorted(set(control) & set(pairs))
            if shared:
                raise ValueError(f"the control must be disjoint from the ablated set; both hold {[f'L{l}H{h}' for l, h in shared]}")
        valid = torch.as_tensor(probe.fields["valid"].astype(bool))
        targets = torch.as_tensor(probe.fields["token_b"])
        result = {"heads": [f"L{l}H{h}" for l, h in sorted(set(pairs))], "control_heads": [f"L{l}H{h}" for l, h in control]}
        with untouched(target.module):
            for name, group in (("baseline", []), ("ablated", pairs), ("control", control)):
                keep = torch.ones(L, H)
                for l, h in group:
                    keep[l, h] = 0.0
                logits = self._last_logits(target, probe, [AblationPart(keep)])
                result[name] = metrics.target_scores(logits[valid], targets[valid])
        return result

    def _last_logits(self, target: ProbeTarget, probe: ProbeSet, parts: list) -> torch.Tensor:
        device = target.device
        collector = ProbeCollector(parts)
        out = []
        with target.capture(collector) as forward:
            for batch in self._batches(probe):
                collector.batch = batch
                out.append(forward(probe.tokens[batch].to(device)).logits[:, -1].float().cpu())
        return torch.cat(out)

    def _n_query_heads(self, target: ProbeTarget, probe: ProbeSet) -> tuple[int, list[int]]:
        """Query heads per layer and the blocks with softmax attention, read off one short captured
        forward (works for any target)."""
        counter = HeadCountPart()
        with untouched(target.module):
            self._last_logits(target, probe.subset(1), [counter])
        return counter.n_heads, counter.softmax_layers


def _float_dtype(module: nn.Module) -> torch.dtype:
    """The dtype of the module's first floating-point parameter (float32 without one)."""
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)


def _parse_head(h) -> tuple[int, int]:
    if isinstance(h, str):
        m = re.fullmatch(r"L(\d+)H(\d+)", h.strip())
        if not m:
            raise ValueError(f"heads are named like 'L4H2' (layer 4, head 2), got {h!r}")
        return int(m.group(1)), int(m.group(2))
    l, hh = h
    return int(l), int(hh)


def has_non_finite(values: dict) -> bool:
    """Whether a probe's attention statistics hold NaN or inf (NaN/inf activations): recorded as null."""
    # PR is left out: a head whose output is exactly zero has an undefined PR without any fault.
    # Blocks without softmax attention (hybrid stacks) are NaN rows of the attention arrays by design.
    softmax = values.get("softmax_layers")
    for key in ("sink_alpha", "p0_norm_ratio", "induction_score"):
        v = values.get(key)
        if v is None:
            continue
        v = np.asarray(v, dtype=float)
        if key != "p0_norm_ratio" and softmax is not None:
            v = v[list(softmax)]
        if not np.all(np.isfinite(v)):
            return True
    v = values.get("sink_rate")
    return v is not None and not math.isfinite(v)
