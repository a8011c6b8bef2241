"""The paper protocol's attention rounding and PR sample, on tiny models (no weights needed).

The paper read its attention weights from eager float16 attention (QK^T in float16, softmax in
float32, cast back to float16); ``protocol="paper"`` rounds the same way, one query row per
sequence, so its selectivity ratios equal those from ``output_attentions=True`` to the last bit.
"""

import numpy as np
import pytest
import torch
from tiny_models import build

from sinkwatch import InductionProbe, Monitor, MonitorConfig
from sinkwatch import metrics as M


def eager_half_selectivity(model, probe_set) -> dict[str, np.ndarray]:
    """Independent path: the model's own eager float16 attention with output_attentions=True."""
    T = probe_set.seq_len
    cols, layout = M.selectivity_columns(T, probe_set.fields["ab"], probe_set.fields["baseline_positions"])
    rows = []
    with torch.no_grad():
        for b0 in range(0, probe_set.n, 8):
            out = model(probe_set.tokens[b0 : b0 + 8], output_attentions=True)
            last = torch.stack([a[:, :, T - 1, :] for a in out.attentions], dim=1)  # (b, L, H, T) float16
            c = torch.as_tensor(cols[b0 : b0 + 8])[:, None, None, :].expand(-1, *last.shape[1:3], -1)
            rows.append(last.gather(-1, c).float().numpy())
    return M.selectivity(np.concatenate(rows), layout, probe_set.fields["valid"].astype(bool))


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_paper_rounding_equals_eager_float16_to_the_last_bit(family):
    model = build(family, seed=1).half().eval()
    model.set_attn_implementation("eager")  # the paper's forward: every layer's input from eager float16 attention
    probe = InductionProbe(n=20, seq_len=64)
    paper = Monitor([probe], config=MonitorConfig(protocol="paper", participation_ratio=False))
    sets = paper.probe_sets(model.config.vocab_size)
    ours = paper.probe(model).values["selectivity"]
    ref = eager_half_selectivity(model, sets[0])
    for c in M.SELECTIVITY_CLASSES:
        assert np.array_equal(ours[c], ref[c]), c  # bit for bit
    default = Monitor([probe], config=MonitorConfig(participation_ratio=False)).probe(model)
    assert default.values["protocol"] == "sinkwatch"
    diff = max(np.abs(default.values["selectivity"][c] - ref[c]).max() for c in M.SELECTIVITY_CLASSES)
    assert diff > 0  # the float32 statistics really round otherwise: the test can tell the two apart


def test_paper_pr_uses_the_first_500_sequences_and_equals_the_n500_batch():
    model = build("llama", seed=2).eval()
    cfg = dict(batch_tokens=64 * 64)  # 64 sequences a forward: the 500th falls inside a micro-batch
    paper = Monitor([InductionProbe(n=600, seq_len=64)], config=MonitorConfig(protocol="paper", **cfg)).probe(model)
    n500 = Monitor([InductionProbe(n=500, seq_len=64)], config=MonitorConfig(**cfg)).probe(model)
    full = Monitor([InductionProbe(n=600, seq_len=64)], config=MonitorConfig(**cfg)).probe(model)
    assert paper.values["pr_sequences"] == 500 and n500.values["pr_sequences"] == 500 and full.values["pr_sequences"] == 600
    np.testing.assert_allclose(paper.values["pr"], n500.values["pr"], rtol=1e-12, atol=0)
    assert not np.allclose(full.values["pr"], n500.values["pr"], rtol=1e-6)
    rec = paper.to_record()
    assert rec["protocol"] == "paper" and rec["pr_sequences"] == 500
    with pytest.raises(ValueError, match="protocol must be one of"):
        MonitorConfig(protocol="xu")


def test_paper_ablation_control_draws_min_picks_eligible_in_a_short_layer():
    model = build("llama", seed=3).eval()
    heads = ["L0H0", "L0H1", "L0H2"]  # 3 of 4 heads: one eligible for the control
    probe = [InductionProbe(n=8, seq_len=64)]
    with pytest.raises(ValueError, match="min\\(picks, eligible\\)"):
        Monitor(probe).ablate(model, heads)
    res = Monitor(probe, config=MonitorConfig(protocol="paper")).ablate(model, heads)
    assert res["control_heads"] == ["L0H3"] and res["heads"] == heads


def test_an_explicit_ablation_control_is_used_as_given_and_must_be_disjoint():
    """Monitor.ablate(control=...) scores exactly that set (equal to ablating it as the set itself);
    a control that overlaps the set or names a missing head is refused."""
    model = build("llama", seed=3).eval()
    mon = Monitor([InductionProbe(n=8, seq_len=64)], config=MonitorConfig(protocol="paper"))
    res = mon.ablate(model, ["L0H0", "L1H2"], control=[(1, 3), "L0H1"])
    assert res["control_heads"] == ["L0H1", "L1H3"] and res["heads"] == ["L0H0", "L1H2"]
    assert res["control"] == mon.ablate(model, ["L0H1", "L1H3"])["ablated"]
    assert res["control"] != mon.ablate(model, ["L0H0", "L1H2"])["control"]  # not the call's own draw
    with pytest.raises(ValueError, match="disjoint"):
        mon.ablate(model, ["L0H0"], control=["L0H0"])
    with pytest.raises(ValueError, match="control head L7H0 does not exist"):
        mon.ablate(model, ["L0H0"], control=["L7H0"])
