"""Imports point down: every module of jaxamp/_src imports only modules of lower layers.

The layers are declared here, bottom first, as docs/design.md draws them; a
module that is not placed, or an import of the same or a higher layer, fails.
Imports under ``if TYPE_CHECKING:`` count too: the module map allows none.
The imports column of design.md's facade table is checked against the code.
"""

import ast
import pathlib
import re

SRC = pathlib.Path(__file__).resolve().parent.parent / "jaxamp" / "_src"
DESIGN = SRC.parent.parent / "docs" / "design.md"

LAYERS = [
    ["compat"],
    ["validation", "sharding", "numerics", "autocast_ops", "jaxpr_interp",
     "facade.errors", "facade.mmengine.sharding_pins"],
    ["outside", "policy", "fp8_autocast"],
    ["state", "finite", "autocast", "facade.mmengine.trees"],
    ["selective_update", "clipping", "fp8", "low_precision", "facade.scaled_loss"],
    ["loss_scale", "accumulation", "microbatch", "train_state", "nnx_optimizer", "deprecated"],
    ["facade.stall", "facade.mmengine.counting", "facade.mmengine.clip",
     "facade.mmengine.jit_args", "facade.stages", "facade.holder", "facade.scaler_state",
     "facade.hyperparam_codecs"],
    ["facade.mmengine.param_groups"],
    ["facade.torch", "facade.paddle", "facade.torch_optimizers", "facade.mmengine.optim_wrapper"],
    ["facade.mmengine.amp_optim_wrapper", "facade.mmengine.optim_wrapper_dict"],
    ["facade.builder"],
]
RANK = {module: rank for rank, layer in enumerate(LAYERS) for module in layer}
# Upward imports made inside a function, at call time, as docs/design.md records them.
LAZY = {("outside", "state")}


def _modules():
  for path in sorted(SRC.rglob("*.py")):
    parts = path.relative_to(SRC).with_suffix("").parts
    if parts[-1] == "__init__":
      continue
    yield ".".join(parts), path


def _imports(source):
  """The jaxamp._src modules ``source`` imports, at run time or for annotations."""
  found = set()

  def visit(node):
    for child in ast.iter_child_nodes(node):
      if isinstance(child, ast.ImportFrom) and child.module and (
          child.module.startswith("jaxamp._src")):
        base = child.module[len("jaxamp._src"):].lstrip(".")
        for alias in child.names:
          name = f"{base}.{alias.name}".lstrip(".")
          found.add(name if name in RANK else base)
      elif isinstance(child, ast.Import):
        for alias in child.names:
          if alias.name.startswith("jaxamp._src."):
            found.add(alias.name[len("jaxamp._src."):])
      visit(child)

  visit(ast.parse(source))
  return found - {""}


def test_every_module_has_a_layer():
  assert sorted(m for m, _ in _modules() if m not in RANK) == []


def test_imports_point_down():
  upward = [f"{module} (layer {RANK[module]}) imports {dep} (layer {RANK.get(dep)})"
            for module, path in _modules() for dep in sorted(_imports(path.read_text()))
            if dep in RANK and RANK[dep] >= RANK[module] and (module, dep) not in LAZY]
  assert upward == []


def test_the_check_sees_upward_imports_typing_only_ones_included():
  source = ("from typing import TYPE_CHECKING\n"
            "from jaxamp._src.facade import builder\n"
            "import jaxamp._src.loss_scale\n"
            "if TYPE_CHECKING:\n"
            "  from jaxamp._src.facade.mmengine.optim_wrapper import OptimWrapper\n")
  assert _imports(source) == {"facade.builder", "loss_scale", "facade.mmengine.optim_wrapper"}
  ranks = [RANK[m] for m in sorted(_imports(source))]
  assert max(ranks) >= RANK["facade.mmengine.param_groups"]  # would fail there, pointing up


def _design_imports():
  """``{module: short names}`` from the imports column of design.md's facade table."""
  rows = {}
  for line in DESIGN.read_text().splitlines():
    match = re.match(r"\| `(facade/[\w/]+)\.py` \|.*\| ([^|]*) \|$", line)
    if match:
      rows[match.group(1).replace("/", ".")] = set(re.findall(r"`(\w+)`", match.group(2)))
  return rows


def test_the_module_map_lists_every_facade_import():
  listed = _design_imports()
  facade = {module: path for module, path in _modules() if module.startswith("facade.")}
  assert sorted(set(facade) ^ set(listed)) == []
  wrong = {}
  for module, path in facade.items():
    actual = {dep.split(".")[-1] for dep in _imports(path.read_text())}
    if actual != listed[module]:
      wrong[module] = {"missing": sorted(actual - listed[module]),
                       "not imported": sorted(listed[module] - actual)}
  assert wrong == {}
