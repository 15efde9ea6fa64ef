"""The first load of a GGUF model says so on stderr, never on stdout (where generated text goes)."""

from __future__ import annotations

import pytest

from eyas.models import registry


def test_the_conversion_notice_goes_to_stderr(tmp_path, monkeypatch, capsys):
    import transformers

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop()

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", stop)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(64))
    with pytest.raises(Stop):
        registry.gguf_to_folder(gguf, tmp_path / "cache")
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "[eyas] converting model.gguf once to" in captured.err
