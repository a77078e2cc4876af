"""The figures in the docs stay true: each region is its rendering, and what is not a timing is
checked against the code.

``benchmarks/render_docs.py`` owns the regions of README.md and docs/*.md that hold figures. Here:

- every region equals its rendering: the line counts and bytes per parameter computed from the
  sources now, the timings and the other recorded figures from ``benchmarks/results/*.json`` (a
  hand edit fails; a re-run benchmark needs a render);
- the recorded drift and convergence figures are what the code computes now;
- every module of ``jaxamp/_src`` is on the module map of docs/design.md, and every module the
  map names exists;
- the warnings and errors the docs quote are what jaxamp says, and the defaults they quote are
  the signatures' defaults;
- every results file comes from a job of ``benchmarks/refresh.py`` and says where it came from.

Timings are never asserted: ``python benchmarks/refresh.py`` refreshes them.
"""

import inspect
import json
import pathlib
import re
import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from jaxamp._src.loss_scale import DEFAULT_STALL_AFTER
from benchmarks import refresh
from benchmarks import render_docs

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = render_docs.pages()


def _regions():
  return sorted({(page.relative_to(ROOT).as_posix(), name) for page in PAGES
                 for name in render_docs.region_names(page.read_text())})


def _fix(names) -> str:
  return " ".join(["python benchmarks/render_docs.py", *names])


@pytest.mark.parametrize("page, name", _regions())
def test_every_region_is_its_rendering(page, name):
  # The memory figures' region traces the LM's optimizer states: default promotion, as a script.
  with jax.numpy_dtype_promotion("standard"):
    stale = render_docs.stale_regions(ROOT / page, only=[name])
  assert not stale, (
      f"{page}: the region {name!r} differs from what the code and benchmarks/results/ give; "
      f"run `{_fix([name])}` (`{_fix([])}` renders every region; it needs no benchmark run, "
      "unless a benchmark's own output changed: then `python benchmarks/refresh.py JOB` first)")


def test_the_line_counts_of_the_design_notes_are_the_files():
  stale = render_docs.stale_regions(ROOT / "docs" / "design.md", only=["design-line-counts"])
  assert not stale, ("docs/design.md's line counts differ from the files: run "
                     f"`{_fix(['design-line-counts'])}`")


def test_a_line_count_edited_by_hand_is_caught(tmp_path):
  page = tmp_path / "design.md"
  shutil.copy(ROOT / "docs" / "design.md", page)
  text = page.read_text()
  count = render_docs.module_lines()["_src/finite.py"]
  row = f"| `_src/finite.py` |  | {count} |"
  assert row in text
  page.write_text(text.replace(row, f"| `_src/finite.py` |  | {count + 1} |"))
  assert render_docs.stale_regions(page) == ["design-line-counts"]
  page.write_text(render_docs.render_text(page.read_text()))
  assert render_docs.stale_regions(page) == []


def test_a_figure_edited_by_hand_inside_a_sentence_is_caught(tmp_path):
  page = tmp_path / "design.md"
  text = (ROOT / "docs" / "design.md").read_text()
  edited = re.sub(r"(<!-- fig: optim-wrapper-code-lines -->about )(\d+)",
                  lambda m: m.group(1) + str(int(m.group(2)) + 10), text)
  assert edited != text
  page.write_text(edited)
  assert render_docs.stale_regions(page) == ["optim-wrapper-code-lines"]


def test_every_region_has_a_renderer_and_every_renderer_a_region():
  used = {name for _, name in _regions()}
  assert used == set(render_docs.REGIONS), (
      f"regions without a renderer: {sorted(used - set(render_docs.REGIONS))}; renderers "
      f"without a region: {sorted(set(render_docs.REGIONS) - used)}")


def test_the_recorded_drift_and_convergence_are_what_the_code_computes():
  from benchmarks import bench_low_precision

  recorded = render_docs.Results("low_precision_numerics").runs[-1]["results"]
  now = {"drift": bench_low_precision.drift_figures(),
         "convergence": bench_low_precision.convergence_figures()}
  fix = ("run `python benchmarks/refresh.py low_precision_numerics` and "
         f"`{_fix([])}`")
  for rounding, figures in now["drift"].items():
    for key, value in figures.items():
      assert recorded["drift"][rounding][key] == pytest.approx(value, rel=1e-6), (
          f"drift, {rounding}, {key}: recorded {recorded['drift'][rounding][key]}, now {value}; "
          + fix)
  for name, value in now["convergence"].items():
    assert recorded["convergence"][name] == pytest.approx(value, rel=1e-4), (
        f"convergence, {name}: recorded {recorded['convergence'][name]}, now {value}; " + fix)


# --- the module map ---------------------------------------------------------------------------

SRC = ROOT / "jaxamp" / "_src"
DESIGN = (ROOT / "docs" / "design.md").read_text()
MODULE_MAP = DESIGN[:DESIGN.index("## Line counts")]


def _named(path: pathlib.Path) -> bool:
  relative = path.relative_to(SRC).as_posix()
  names = [relative, f"_src/{relative}"]
  if relative.startswith("facade/mmengine/"):
    names.append(relative.removeprefix("facade/"))
  return any(f"`{name}`" in MODULE_MAP for name in names) or (
      "/" not in relative and f"`{relative}`" in MODULE_MAP)


def test_every_module_is_on_the_module_map():
  missing = [p.relative_to(SRC).as_posix() for p in sorted(SRC.rglob("*.py"))
             if p.name != "__init__.py" and not _named(p)]
  assert not missing, (f"docs/design.md's module map does not name {missing}: add them to it by "
                       "hand (render_docs.py does not write the map)")


def _exists(name: str) -> bool:
  candidates = [SRC / name, SRC / "facade" / name, ROOT / "jaxamp" / name, ROOT / name]
  if "{" in name:  # _src/facade/{holder,stages}.py
    head, _, rest = name.partition("{")
    parts, _, tail = rest.partition("}")
    return all(_exists(f"{head}{part}{tail}") for part in parts.split(","))
  return any(c.exists() for c in candidates) or (ROOT / name.removeprefix("_src/")).exists() or (
      SRC / name.removeprefix("_src/")).exists()


def test_every_module_the_map_names_exists():
  named = set(re.findall(r"`([\w/{},]+\.py)`", MODULE_MAP))
  named |= set(re.findall(r"^\s+(?:\w+\s+)?(_src/[\w/{},]+\.py)", MODULE_MAP, re.M))
  gone = sorted(name for name in named if not _exists(name))
  assert not gone, (f"docs/design.md's module map names modules that do not exist: {gone}; "
                    "update the map by hand (render_docs.py does not write it)")


# --- quoted messages and defaults ---------------------------------------------------------------

_TEXT_BLOCK = re.compile(r"^```text\n((?:\w+\.)?\w+(?:Warning|Error)): (.*?)^```", re.S | re.M)
_INLINE_QUOTE = re.compile(r"`(\w+(?:Warning|Error)): ([^`]+)`")


def quoted_messages():
  """``(page, exception type, message)`` for each warning or error the pages quote."""
  out = []
  for page in PAGES:
    text = page.read_text()
    for pattern in (_TEXT_BLOCK, _INLINE_QUOTE):
      for kind, message in pattern.findall(text):
        out.append((page.relative_to(ROOT).as_posix(), kind, " ".join(message.split())))
  return out


def _as_pattern(message: str) -> re.Pattern:
  """The quoted text as a pattern: ``...`` stands for anything, line breaks for any space."""
  parts = [re.escape(part) for part in message.split("...")]
  return re.compile(".*".join(parts).replace(r"\ ", r"\s+"), re.S)


def _stall_messages():
  """jaxamp's stall warnings: a facade's (the default) and the functional core's (``on_stall="warn"``)."""
  params = {"enc": jnp.ones(3), "dec": jnp.ones(2)}

  def loss(p, x):
    return jnp.sum(p["enc"] * x) + jnp.sum(p["dec"]) * jnp.nan  # dec's gradient is nan

  opt = jaxamp.OptimWrapper(optax.sgd(0.1), params)
  scaler = jaxamp.GradScaler()
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), on_stall="warn")

  @jax.jit
  def step(state, x):
    grads = jax.grad(lambda p: jaxamp.scale_loss(loss(p, x), state))(params)
    return tx.update(grads, state, params)[1]

  state = tx.init(params)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(DEFAULT_STALL_AFTER + 2 * 10):  # 10: the facades' stall_check_every
      opt.zero_grad()
      opt.backward(scaler.scale(loss), jnp.ones(3))
      scaler.step(opt)
      scaler.update()
      state = step(state, jnp.ones(3))
      jax.effects_barrier()
  return [("StallWarning", " ".join(str(w.message).split())) for w in caught
          if issubclass(w.category, jaxamp.StallWarning)]


def _error_messages():
  out = []
  with pytest.raises(ValueError) as refused:
    jaxamp.dynamic_loss_scale(optax.sgd(0.1)).init({"w": jnp.ones(2, jnp.float16)})
  out.append(("ValueError", str(refused.value)))
  return out


def test_the_warnings_and_errors_the_docs_quote_are_what_jaxamp_says():
  said = _stall_messages() + _error_messages()
  assert len(said) >= 3, said  # a facade's stall, the core's, and the refusal
  quotes = quoted_messages()
  assert quotes
  unmatched = [(page, kind, message) for page, kind, message in quotes
               if not any(kind.rsplit(".", 1)[-1] == got_kind
                          and _as_pattern(message).match(got) for got_kind, got in said)]
  assert not unmatched, (f"quoted in the docs but not said by jaxamp: {unmatched}; said: {said}. "
                         "Edit the quote on that page to what jaxamp says (by hand: quotes are "
                         "not rendered)")


_DEFAULTS = re.compile(r"defaults? \(((?:`\w+=[^`]+`,?\s*)+)\)")
_THE_DEFAULT = re.compile(r"`(\w+)=([^`]+)`(?: \(the default\)|, the default)")


def quoted_defaults():
  """``(page, name, value)`` for each ``name=value`` the pages call a default."""
  out = []
  for page in PAGES:
    text = " ".join(page.read_text().split())
    for group in _DEFAULTS.findall(text):
      out += [(page.relative_to(ROOT).as_posix(), *pair.split("=", 1))
              for pair in re.findall(r"`(\w+=[^`]+)`", group)]
    out += [(page.relative_to(ROOT).as_posix(), name, value)
            for name, value in _THE_DEFAULT.findall(text)]
  return out


def _public_defaults():
  """``{parameter: [default values]}`` over jaxamp's public callables (classes: __init__) and the
  JAX functions whose defaults the docs quote."""
  out = {}
  callables = [getattr(module, name) for module in (jaxamp, jaxamp.paddle)
               for name in module.__all__] + [jax.shard_map]
  for obj in callables:
    if not callable(obj) or isinstance(obj, type) and issubclass(obj, BaseException):
      continue
    for param in inspect.signature(obj).parameters.values():
      if param.default is not inspect.Parameter.empty:
        out.setdefault(param.name, []).append(param.default)
  return out


def test_the_defaults_the_docs_quote_are_the_signatures():
  defaults = _public_defaults()
  quotes = quoted_defaults()
  assert len(quotes) >= 5, quotes
  wrong = []
  for page, name, value in quotes:
    expected = eval(value, {"jnp": jnp, "np": np})  # noqa: S307 -- the docs' own literals
    if not any(type(d) is type(expected) and d == expected or (
        isinstance(d, float) and d == expected) for d in defaults.get(name, [])):
      wrong.append((page, name, value, defaults.get(name)))
  assert not wrong, (f"defaults quoted in the docs that no public signature has: {wrong}; edit "
                     "the page to the signature's default (by hand: quotes are not rendered)")


# --- the results files ------------------------------------------------------------------------


def test_every_results_file_comes_from_a_refresh_job_and_says_where_it_came_from():
  files = {p.stem: p for p in render_docs.RESULTS.glob("*.json")}
  assert set(files) == set(refresh.JOBS), (
      f"results files without a job: {sorted(set(files) - set(refresh.JOBS))}; jobs without "
      f"results: {sorted(set(refresh.JOBS) - set(files))} (python benchmarks/refresh.py JOB)")
  for name, path in files.items():
    runs = json.loads(path.read_text())["runs"]
    assert runs, name
    job = refresh.JOBS[name]
    for run in runs:
      prov = run["provenance"]
      assert prov["command"].startswith(f"python benchmarks/{job.script}"), (name, prov)
      assert re.fullmatch(r"[0-9a-f]{7,}", prov["commit"]), (name, prov)
      assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", prov["date"]), (name, prov)
      assert prov["machine"]["cpu"] and prov["machine"]["cores"] >= 1, (name, prov)
      assert prov["jax"], (name, prov)
