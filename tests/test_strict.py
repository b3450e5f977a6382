"""``Options.strict``: an internal error of a pass falls back to the original graph (default) or raises
(strict, BRCOMPILE_STRICT=1, which tests/conftest.py sets for the whole suite); CannotReplay, a typed
refusal, falls back in both modes."""
import importlib

import pytest
import torch

import brcompile
from brcompile.backend import Options
from examples.gpt import GPT, GPTConfig

backend_mod = importlib.import_module("brcompile.backend")  # the attribute brcompile.backend is the function
pipeline_mod = importlib.import_module("brcompile.passes.pipeline")


def _model():
    cfg = GPTConfig(vocab_size=29, dim=16, n_layers=1, n_heads=2, n_kv_heads=2, hidden_dim=24)
    return GPT(cfg, seed=0).to(torch.float64)


def _ids():
    prompt = torch.randint(0, 29, (1, 7), generator=torch.Generator().manual_seed(0)).expand(4, 7)
    tails = torch.randint(0, 29, (4, 3), generator=torch.Generator().manual_seed(1))
    return torch.cat([prompt, tails], dim=1)


def _broken_rewrite(*args, **kwargs):
    raise RuntimeError("a bug in a pass")


def test_env_sets_the_default(monkeypatch):
    monkeypatch.setenv("BRCOMPILE_STRICT", "1")
    assert Options().strict
    monkeypatch.setenv("BRCOMPILE_STRICT", "0")
    assert not Options().strict
    monkeypatch.delenv("BRCOMPILE_STRICT")
    assert not Options().strict
    assert Options(strict=True).strict


def test_suite_runs_strict():
    assert backend_mod.default_backend().options.strict


def test_internal_error_falls_back_when_not_strict(monkeypatch):
    monkeypatch.setattr(pipeline_mod, "build_packed_graph", _broken_rewrite)
    model, ids = _model(), _ids()
    be = brcompile.backend(compiler="eager", strict=False)
    out = torch.compile(model, backend=be)(ids)
    torch.testing.assert_close(out, model(ids), rtol=0, atol=0)
    (rec,) = be.records
    assert not rec.rewritten and rec.reason == "internal error: RuntimeError: a bug in a pass"
    assert rec.code is brcompile.Code.INTERNAL_ERROR
    assert brcompile.stats().fallback_calls == 1
    assert brcompile.stats().fallback_codes == {brcompile.Code.INTERNAL_ERROR: 1}


def test_internal_error_raises_when_strict(monkeypatch):
    monkeypatch.setattr(pipeline_mod, "build_packed_graph", _broken_rewrite)
    be = brcompile.backend(compiler="eager", strict=True)
    with pytest.raises(Exception, match="a bug in a pass"):
        torch.compile(_model(), backend=be)(_ids())


def test_cannot_replay_falls_back_when_strict(monkeypatch):
    def refuse(*args, **kwargs):
        raise brcompile.CannotReplay(brcompile.Code.MASK_NOT_CAUSAL, "not this graph")

    monkeypatch.setattr(pipeline_mod, "build_packed_graph", refuse)
    model, ids = _model(), _ids()
    be = brcompile.backend(compiler="eager", strict=True)
    out = torch.compile(model, backend=be)(ids)
    torch.testing.assert_close(out, model(ids), rtol=0, atol=0)
    (rec,) = be.records
    assert not rec.rewritten and rec.reason == "not this graph" and rec.code is brcompile.Code.MASK_NOT_CAUSAL


def test_streaming_split_internal_error(monkeypatch):
    """mode="replay": a failing split runs the packed mode (not strict) or raises (strict)."""
    import brcompile.passes.emit.split as replay_pass

    monkeypatch.setattr(replay_pass, "split_for_replay", _broken_rewrite)
    model, ids = _model(), _ids()
    be = brcompile.backend(compiler="eager", mode="replay", strict=False)
    out = torch.compile(model, backend=be)(ids)
    torch.testing.assert_close(out, model(ids), rtol=1e-10, atol=1e-10)
    (rec,) = be.records
    assert rec.rewritten and rec.replay_reason == "internal error: RuntimeError: a bug in a pass"
    assert rec.replay_code is brcompile.Code.INTERNAL_ERROR
    assert brcompile.stats().replayed_calls == 1
    torch._dynamo.reset()
    be = brcompile.backend(compiler="eager", mode="replay", strict=True)
    with pytest.raises(Exception, match="a bug in a pass"):
        torch.compile(model, backend=be)(ids)


@pytest.mark.parametrize("strict", [False, True])
def test_a_failing_packed_forward_runs_the_original(strict):
    """A packed graph that raises at run time (a rewrite bug the compile-time checks missed): the original
    graph runs, exactly, with the reason recorded — or, strict, the error reaches the caller."""
    model = _model()
    backend = brcompile.backend(compiler="eager", strict=strict)
    compiled = torch.compile(lambda ids: model(ids).sum(), backend=backend)
    ids = _ids()
    compiled(ids)
    assert brcompile.stats().replayed_calls == 1
    rt = backend.records[0].runtime
    rt.packed = _broken_rewrite
    if strict:
        with pytest.raises(RuntimeError, match="a bug in a pass"):
            compiled(ids)
        return
    out = compiled(ids)
    assert torch.equal(out, model(ids).sum())
    s = brcompile.stats()
    assert s.replayed_calls == 1 and s.fallback_calls == 1, str(s)
    assert s.fallback_codes == {brcompile.Code.INTERNAL_ERROR: 1}, str(s)
    assert any("internal error running the packed graph: RuntimeError: a bug in a pass" in r
               for r in s.details(brcompile.Code.INTERNAL_ERROR)), str(s)
