"""A same-seed SC-GRPO run on CPU, by this tree and by an earlier one: each step's advantages, token weights,
divergences, rows in the loss and loss must be equal, bit for bit. Both trees run their passes padded (packing off:
a packed pass's rounding depends on how its rows pack); packed against padded states are compared, within rounding,
by tests/test_packing.py.

    git archive <commit> src tests | tar -x -C /tmp/before
    python scripts/same_seed_check.py --before /tmp/before

Both runs train the tests' tiny Llama (random weights, built once in a scratch folder) with the tests' settings
(tests/helpers.py: 4 arithmetic prompts x G=4, 8 new tokens, LoRA r=4) for ``--steps`` steps, seed 0, each in
a subprocess that imports that tree's package. Every value the runs log (metrics.csv, but the times) must be equal
too. Exits 1 at the first difference.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RUN = r'''
import json, os, sys
tree, folder, out, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
sys.path[:0] = [os.path.join(tree, "src"), tree]
import lightning.pytorch as pl
from scgrpo import packing  # padded passes in both trees: a packed pass's rounding depends on how its rows pack
if hasattr(packing, "ENABLED"):  # (a tree whose switch is the module's)
    packing.ENABLED = False
from tests.conftest import build_tiny_llama, build_tokenizer
from tests.helpers import tiny_data, tiny_module, tiny_trainer
from scgrpo.objectives import SCGRPO
if not os.path.exists(os.path.join(folder, "config.json")):
    tokenizer = build_tokenizer()
    build_tiny_llama(len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
pl.seed_everything(0)
module = tiny_module(folder, objective=SCGRPO())
class Padded(pl.Callback):  # (a tree whose switch is the policy's pass options)
    def on_fit_start(self, trainer, pl_module):
        if hasattr(pl_module.actor, "passes"):
            import dataclasses
            pl_module.actor.passes = dataclasses.replace(pl_module.actor.passes, packing=False)
hook = "log_step" if hasattr(module, "log_step") else "_log_step"  # (its name in the tree; rollouts, plan, sums first)
records, log_step = [], getattr(module, hook)
def record(*args):
    plan, sums = args[1], args[2]
    records.append({"advantages": plan.credit.advantages.tolist(), "token_weights": plan.credit.token_weights.tolist(),
                    "divergence": plan.signal.divergence.tolist(), "rows": plan.rows.tolist(), "loss": sums["loss"]})
    return log_step(*args)
setattr(module, hook, record)
tiny_trainer(os.path.join(os.path.dirname(out), "logs-" + os.path.basename(out)), max_steps=steps,
             callbacks=[Padded()]).fit(module, datamodule=tiny_data())
import csv, glob
(metrics,) = glob.glob(os.path.join(os.path.dirname(out), "logs-" + os.path.basename(out), "run", "*", "metrics.csv"))
rows = [{k: v for k, v in row.items() if v != "" and not k.startswith("time/")} for row in csv.DictReader(open(metrics))]
json.dump({"steps": records, "logged": rows}, open(out, "w"))
'''


def run(tree: str, folder: str, out: str, steps: int) -> list[dict]:
    env = dict(os.environ, PYTHONPATH="")
    subprocess.run([sys.executable, "-c", RUN, tree, folder, out, str(steps)], check=True, env=env,
                   capture_output=True, text=True)
    with open(out) as f:
        return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", required=True, help="an earlier tree holding src/ and tests/")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        folder = os.path.join(scratch, "model")
        os.makedirs(folder)
        before = run(os.path.realpath(args.before), folder, os.path.join(scratch, "before.json"), args.steps)
        after = run(ROOT, folder, os.path.join(scratch, "after.json"), args.steps)
    logged_before, logged_after, before, after = before["logged"], after["logged"], before["steps"], after["steps"]
    if len(before) != len(after):
        sys.exit(f"{len(before)} steps before, {len(after)} now")
    for step, (old, new) in enumerate(zip(before, after)):
        differ = [name for name in old if old[name] != new[name]]
        if differ:
            print(f"step {step}: {', '.join(differ)} differ")
            sys.exit(1)
        print(f"step {step}: advantages, token weights, divergences, rows and loss equal (loss {new['loss']:.9g})")
    differ = [(i, k) for i, (old, new) in enumerate(zip(logged_before, logged_after)) for k in {**old, **new}
              if old.get(k) != new.get(k)]
    if len(logged_before) != len(logged_after) or differ:
        print(f"logged values differ: {differ[:5]} ({len(logged_before)} rows before, {len(logged_after)} now)")
        sys.exit(1)
    print(f"every logged value but the times equal ({len(logged_after)} rows of metrics.csv, "
          f"{len(set().union(*logged_after))} columns)")


if __name__ == "__main__":
    main()
