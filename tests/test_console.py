"""Console tables and progress: aligned columns, numbers with separators, at most ten progress lines off a terminal."""

from hstap.console import Progress, num, table


def test_table_aligns_columns():
    out = table(["stage", "figures"], [["capture", "1,024 tokens"], ["eval", "tau 1.850"]]).splitlines()
    assert out == ["  stage    figures", "  -------  ------------", "  capture  1,024 tokens", "  eval     tau 1.850"]
    assert table(None, [["a", "b"]]) == "  a  b"
    assert num(12345.6) == "12,346" and num(3.14159, 2) == "3.14"


def test_progress_off_a_terminal_prints_at_most_ten_lines(capsys):
    p = Progress("hstap eval: eagle", 37, "prompts")
    for i in range(37):
        p.update(1, f"{i}.0 tokens/s")
    p.close()
    lines = capsys.readouterr().err.splitlines()  # pytest's capture is not a terminal
    assert len(lines) == 10 and lines[-1] == "hstap eval: eagle: 37/37 prompts, 36.0 tokens/s"
