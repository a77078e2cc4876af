"""The documentation site builds with ``mkdocs build --strict`` and documents every public name.

Skipped when the ``docs`` extra (mkdocs, mkdocs-material, mkdocstrings) is not installed.
"""

import importlib
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys

import jax
import pytest

import jaxamp

ROOT = pathlib.Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None
        for m in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers")),
    reason="the docs extra (mkdocs-material, mkdocstrings[python]) is not installed")

# Modules whose whole ``__all__`` must appear in the API reference.
PUBLIC_MODULES = ("jaxamp", "jaxamp.paddle", "jaxamp.nnx")

# Pages whose ``python`` code blocks are run, in order, in one namespace per page.
RUNNABLE_PAGES = ("getting-started.md", "concepts.md", "flax.md", "autocast.md",
                  "fp8-autocast.md")


def _build(config: pathlib.Path, site_dir: pathlib.Path) -> subprocess.CompletedProcess:
  # No --quiet: with it, mkdocs 1.6 does not count warnings and --strict passes anyway.
  env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
  return subprocess.run(
      [sys.executable, "-m", "mkdocs", "build", "--strict",
       "--config-file", str(config), "--site-dir", str(site_dir)],
      cwd=ROOT, capture_output=True, text=True, env=env, timeout=300, check=False)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
  site_dir = tmp_path_factory.mktemp("site")
  proc = _build(ROOT / "mkdocs.yml", site_dir)
  assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
  return site_dir


def test_strict_build_produces_every_page(site):
  for page in ("index", "getting-started/index", "concepts/index", "flax/index",
               "distributed/index", "porting/index", "examples/index", "benchmarks/index",
               "api/index"):
    assert (site / f"{page}.html").exists() or (site / page / "index.html").exists(), page


def _documented_ids(site: pathlib.Path) -> set:
  ids = set()
  for page in (site / "api").rglob("*.html"):
    ids.update(re.findall(r'id="([\w.]+)"', page.read_text(encoding="utf-8")))
  return ids


def test_every_public_name_is_in_the_api_reference(site):
  ids = _documented_ids(site)
  missing = []
  for module_name in PUBLIC_MODULES:
    if importlib.util.find_spec(module_name) is None:
      continue
    module = importlib.import_module(module_name)
    missing += [f"{module_name}.{name}" for name in module.__all__
                if f"{module_name}.{name}" not in ids]
  assert not missing, f"public names missing from docs/api: {missing}"


def test_api_index_lists_every_public_name():
  index = (ROOT / "docs" / "api" / "index.md").read_text(encoding="utf-8")
  missing = [name for name in jaxamp.__all__
             if f"`{name}`" not in index and f"`jaxamp.{name}." not in index]
  assert not missing, f"docs/api/index.md does not list {missing}"


def test_broken_reference_fails_the_strict_build(tmp_path):
  """A reference to a name or a page that does not exist must fail the build."""
  docs = tmp_path / "docs"
  shutil.copytree(ROOT / "docs", docs)
  with open(docs / "index.md", "a", encoding="utf-8") as page:
    page.write("\nSee [nothing][jaxamp.no_such_name] and [no page](no-such-page.md).\n")
  config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
  config = config.replace("docs_dir: docs", f"docs_dir: {docs}")
  config = config.replace('paths: ["."]', f'paths: ["{ROOT}"]')
  (tmp_path / "mkdocs.yml").write_text(config, encoding="utf-8")
  proc = _build(tmp_path / "mkdocs.yml", tmp_path / "site")
  assert proc.returncode != 0
  log = proc.stdout + proc.stderr
  assert "jaxamp.no_such_name" in log and "no-such-page.md" in log, log


def test_docstring_markup_is_rewritten_for_markdown():
  sys.path.insert(0, str(ROOT / "docs" / "_griffe"))
  try:
    rst_markup = importlib.import_module("rst_markup")
  finally:
    sys.path.pop(0)
  text = ("Uses :func:`scale_loss` and :class:`~jaxamp.Policy`; the rule::\n\n"
          "  if found_inf:\n    skip()\n\nThe end.")
  assert rst_markup.rst_to_markdown(text) == (
      "Uses `scale_loss` and `jaxamp.Policy`; the rule:\n\n"
      "```python\nif found_inf:\n  skip()\n```\n\nThe end.")


def _python_blocks(markdown: str) -> list:
  return re.findall(r"^```python\n(.*?)^```", markdown, flags=re.S | re.M)


@pytest.mark.parametrize("page", RUNNABLE_PAGES)
def test_code_blocks_run(page):
  blocks = _python_blocks((ROOT / "docs" / page).read_text(encoding="utf-8"))
  assert blocks, f"no python blocks in {page}"
  namespace = {"__name__": f"docs_{page}"}
  # The pages show user code, written for JAX's default promotion rules (optax
  # itself needs them), not for the strict ones the test suite sets.
  with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
    for block in blocks:
      exec(compile(block, f"docs/{page}", "exec"), namespace)
