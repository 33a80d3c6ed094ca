"""``pccl-sim --help`` reads as plain text: the module docstring's reST markup is stripped."""

from __future__ import annotations

import pytest

from pccl_sim.tools import cli


def test_the_help_shows_no_rest_markup(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "pccl-sim: chaos-test pccl" in text
    assert "pccl-sim replay --seed 7" in text  # the usage examples are shown, as written
    assert "``" not in text and ":mod:" not in text, text


def test_plain_text_strips_roles_and_literals() -> None:
    assert cli.plain_text("``--scenario`` (:mod:`pccl_sim.tools.scenarios`, :class:`~a.B`)") == \
        "--scenario (pccl_sim.tools.scenarios, a.B)"
