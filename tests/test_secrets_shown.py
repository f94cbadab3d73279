"""`show` and `export` keep secrets out of what they print and write (docs/security.md; issue 37, item 9): a secret
resolved from the environment (`env:NAME`) or given literally is `<redacted>`, and export says which keys it left."""
from __future__ import annotations

import json

import pytest

from trainer.__main__ import main

SECRET = "comet-secret-93be1d"


@pytest.mark.parametrize("given", ["env:COMET_KEY_FOR_SHOW", SECRET])
def test_show_prints_no_secret(given, monkeypatch, capsys):
    monkeypatch.setenv("COMET_KEY_FOR_SHOW", SECRET)
    for extra in ([], ["--json"]):
        assert main(["show", "tiny_cpu", "--set", f"deepspeed.comet={{enabled: false, api_key: {given}}}",
                     *extra]) == 0
        out = capsys.readouterr().out
        assert SECRET not in out and "<redacted>" in out


def test_export_writes_no_secret_and_names_the_key_it_left_out(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("COMET_KEY_FOR_SHOW", SECRET)
    target = tmp_path / "ds.json"
    assert main(["export", "tiny_cpu", "--set", "deepspeed.comet={enabled: false, api_key: env:COMET_KEY_FOR_SHOW}",
                 "-o", str(target)]) == 0
    assert SECRET not in target.read_text()
    assert json.loads(target.read_text())["comet"]["api_key"] == "<redacted>"
    assert "deepspeed.comet.api_key is <redacted> in the exported JSON" in capsys.readouterr().err
