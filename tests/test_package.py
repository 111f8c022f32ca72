"""The package's top level (src/scgrpo/__init__.py): its names load when first asked for, a subpackage is an
attribute, an unknown name is an AttributeError and an error inside a module's import is not mistaken for one."""

from __future__ import annotations

import subprocess
import sys

import pytest

import scgrpo


def test_the_exported_names_are_the_classes_of_their_modules_and_subpackages_are_attributes():
    from scgrpo.data import PromptDataModule
    from scgrpo.module import RLVRModule
    from scgrpo.objectives import GRPO

    assert scgrpo.RLVRModule is RLVRModule and scgrpo.GRPO is GRPO and scgrpo.PromptDataModule is PromptDataModule
    assert set(scgrpo.__all__) - {"__version__"} == set(scgrpo.EXPORTS) and all(
        getattr(scgrpo, name).__name__ == name for name in scgrpo.EXPORTS)
    assert scgrpo.objectives.GRPO is GRPO and "RLVRModule" in dir(scgrpo)
    from scgrpo import LoraSettings  # noqa: F401  (from ... import reaches __getattr__ too)


def test_an_unknown_name_is_an_attribute_error_and_an_error_inside_an_import_is_an_import_error(tmp_path, monkeypatch):
    for name in ("nothing", "a.b", "errors.x"):
        with pytest.raises(AttributeError, match=f"module 'scgrpo' has no attribute {name!r}"):
            getattr(scgrpo, name)
    assert not hasattr(scgrpo, "nothing")
    (tmp_path / "planted_broken.py").write_text("import torch\nBROKEN = torch.no_such_name\n")  # (a name torch removed)
    (tmp_path / "planted_missing.py").write_text("import no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(scgrpo.EXPORTS, "Broken", "planted_broken")
    monkeypatch.setitem(scgrpo.EXPORTS, "Missing", "planted_missing")
    with pytest.raises(ImportError, match="importing planted_broken failed: .*no_such_name") as raised:
        scgrpo.Broken
    assert isinstance(raised.value.__cause__, AttributeError)
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency"):  # (a dependency missing, not a name)
        scgrpo.Missing


def test_importing_the_package_or_its_model_helpers_does_not_import_lightning():
    probe = ("import sys, scgrpo, scgrpo.models, scgrpo.verifiers; "
             "print(sorted(m for m in ('lightning', 'scgrpo.module', 'scgrpo.data') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True)
    assert done.stdout.strip().splitlines()[-1] == "[]"
