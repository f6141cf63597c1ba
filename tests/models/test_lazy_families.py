"""Families register lazily: importing batchvlm, its models package, the registry or the CLI
imports no family; opening a model imports its own family and no other."""

import subprocess
import sys

FAMILIES = ("moondream", "qwen_vl", "qwen3_vl", "qwen3_5", "florence2", "transformers_backend")

PROBE = """
import sys
{imports}
print(sorted({{n.split(".")[2] for n in sys.modules
              if n.startswith("batchvlm.models.") and n.split(".")[2] in {families!r}}}))
"""


def _families_after(imports: str) -> list[str]:
    code = PROBE.format(imports=imports, families=FAMILIES)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return eval(out.stdout.strip().splitlines()[-1])


def test_importing_the_package_imports_no_family():
    assert _families_after("import batchvlm, batchvlm.models, batchvlm.models.registry, batchvlm.cli, "
                           "batchvlm.run") == []


def test_opening_a_model_imports_its_family_alone():
    opened = _families_after("from batchvlm.job import ModelSpec\n"
                             "from batchvlm.models.registry import open_family\n"
                             "open_family(ModelSpec(name='demo'), weights=False)")
    assert opened == ["moondream"]
