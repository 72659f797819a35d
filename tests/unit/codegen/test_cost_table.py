"""`derive --cost`: the generated schedule value by value (shape, FLOPs, bytes), totals, the D identity's saving."""

from __future__ import annotations

import sympy as sp

from symattn.cli import main
from symattn.codegen.report.cost_report import cost_report, formula

n, m, d_k, d_v = (sp.Symbol(s, positive=True, integer=True) for s in ("n", "m", "d_k", "d_v"))


def test_node_flops_add_up_to_the_generated_schedule():
    """Each value's FLOPs are its line's own work, the values it reads given: together, the schedule's count.
    transformer_block's dN_1 = dX_1 ⊙ (𝟏 γ₁) forms the broadcast 𝟏 γ₁ again (the forward's X_1 has it inside):
    its lines count it, the schedule's DAG once."""
    recomputed = {
        "attention": 0,
        "mha": 0,
        "transformer_block": 2 * sp.Symbol("H", positive=True, integer=True) * d_k * n,
    }
    for name, again in recomputed.items():
        report = cost_report(name, sizes=())
        forward = sp.Add(*(node.flops for node in report.nodes if not node.backward))
        backward = sp.Add(*(node.flops for node in report.nodes if node.backward))
        assert sp.expand(forward - report.generated_forward) == 0, name
        assert sp.expand(backward - report.generated_backward - again) == 0, name


def test_a_line_is_costed_down_to_the_values_it_reads_once_each():
    """The node table walks each line's definition down to the values it reads, not below: a stack of L layers
    costs nodes linear in L (before: every line walked everything below it, quadratic)."""
    import sys
    from pathlib import Path

    from symattn.codegen.report.cost_report import node_costs
    from symattn.codegen.schedule.build import schedule_spec
    from symattn.lang.graph import VISITS

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from test_scaling_counts import residual_stack

    def walked(layers: int) -> int:
        sched = schedule_spec(residual_stack(layers))
        VISITS["nodes"] = 0
        node_costs(sched)
        return VISITS["nodes"]

    assert walked(8) / walked(4) <= 2.1


def test_attention_nodes_have_their_shapes_costs_and_saved_marks():
    nodes = {node.name: node for node in cost_report("attention", sizes=()).nodes}
    assert nodes["A"].shape == (n, m) and sp.expand(nodes["A"].flops - 2 * d_k * m * n).as_poly(n, m).degree() <= 1
    assert nodes["P"].saved and nodes["O"].saved and not nodes["A"].saved
    assert nodes["P"].bytes == 4 * n * m  # float32
    assert nodes["dQ"].backward and nodes["dQ"].shape == (n, d_k)


def test_d_identity_names_its_saving():
    # rowsum(dP ⊙ P) over n × m entries becomes rowsum(dO ⊙ O) over n × d_v: saves 2·n·(m − d_v)
    (saving,) = cost_report("attention", sizes=()).savings
    assert "D identity" in saving.what and "rowsum(dP ⊙ P)" in saving.what
    assert sp.expand(saving.flops - 2 * n * (m - d_v)) == 0


def test_cli_cost_is_an_aligned_table(capsys):
    assert main(["derive", "attention", "--cost"]) == 0
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith(("  forward ", "  backward ", "  pass "))]
    assert len(table) >= 3 + 6 + 2  # header, every value, two totals
    columns = {line.index(" n × ") for line in table if " n × " in line}
    assert len(columns) == 1  # the shape column starts at one place in every row
    assert "saves 2·m·n − 2·d_v·n FLOPs" in out
    assert "…" not in out  # nothing truncated


def test_formula_reads_like_print():
    assert formula(2 * d_k * m * n + n**2 - n) == "2·d_k·m·n + n² − n"
