"""Every Python block of README.md and docs/ runs, so the documentation cannot rot. A page's
blocks run in order in one namespace (as a reader would type them), after the page's prelude
below: the objects its text takes as given (a model, a batch, a Trainer), at small sizes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_GPT2 = """
import torch, transformers
import slackswap as ss
torch.manual_seed(0)
model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
    n_layer=2, n_embd=64, n_head=2, n_positions=64, vocab_size=500, bos_token_id=0,
    eos_token_id=0, use_cache=False)).train()
ids = torch.randint(0, 500, (8, 64))
inputs = ids
loss_fn = lambda out: out.logits.float().pow(2).mean()
data = [{"input_ids": ids, "labels": ids}] * 2
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
"""

_TRAINER = (
    _GPT2
    + """
import tempfile, lightning
class _Tokens(torch.utils.data.Dataset):
    def __len__(self): return 8
    def __getitem__(self, i): return {"input_ids": list(range(1, 20 + i))}
def collate(batch):
    width = max(len(b["input_ids"]) for b in batch)
    x = torch.zeros((len(batch), width), dtype=torch.long)
    for i, b in enumerate(batch):
        x[i, :len(b["input_ids"])] = torch.tensor(b["input_ids"])
    return {"input_ids": x, "labels": x}
train = _Tokens()
args = transformers.TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=2,
    per_device_train_batch_size=4, report_to=[], use_cpu=True, save_strategy="no",
    disable_tqdm=True)
trainer = transformers.Trainer(model=model, args=args, train_dataset=train, data_collator=collate)
"""
)

_FSDP = """
import os, torch, transformers
import torch.distributed as dist
import slackswap as ss
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29533")
dist.init_process_group("gloo", rank=0, world_size=1)
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
    num_hidden_layers=2, hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
    intermediate_size=172, vocab_size=500, max_position_embeddings=64)).train()
ids = torch.randint(0, 500, (2, 64))
batch = {"input_ids": ids, "labels": ids}
loss_fn = lambda out: out.loss
hw = "cpu"
"""

PRELUDES = {
    "README.md": _TRAINER,
    "training-loop.md": _GPT2,
    "trainers.md": _TRAINER,
    "distributed.md": _FSDP,
}
NEEDS = {
    "README.md": ["torch", "transformers", "accelerate", "lightning"],
    "training-loop.md": ["torch", "transformers"],
    "trainers.md": ["torch", "transformers", "accelerate", "lightning"],
    "distributed.md": ["torch", "transformers"],
    "fit.md": ["torch", "transformers"],
}


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.S | re.M)


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)], ids=lambda p: p.name)
def test_every_python_block_of_the_page_runs(page, tmp_path, monkeypatch):
    for module in NEEDS.get(page.name, []):
        pytest.importorskip(module)
    monkeypatch.chdir(tmp_path)  # what a block writes (plan.json) goes there
    namespace: dict = {"__name__": "__docs__"}
    try:
        exec(compile(PRELUDES.get(page.name, ""), f"{page.name}:prelude", "exec"), namespace)
        for i, block in enumerate(python_blocks(page)):
            exec(compile(block, f"{page.name}:block{i + 1}", "exec"), namespace)
    finally:
        dist = namespace.get("dist")
        if dist is not None and dist.is_initialized():
            dist.destroy_process_group()


def test_every_page_the_readme_links_exists():
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(((?:docs|formulations|benchmarks)/[^)#]*)", text)
    assert len(links) >= 10
    for link in links:
        assert (ROOT / link).exists(), link
    assert len(text.splitlines()) <= 220  # the front page stays a front page


def fit_commands() -> list[tuple[str, str]]:
    """Every ``slackswap fit`` command of README.md and docs/, continuation lines joined and a
    trailing comment dropped: (page, command)."""
    found = []
    for page in PAGES:
        for block in re.findall(r"^```[a-z]*\n(.*?)^```", page.read_text(), flags=re.S | re.M):
            for command in block.replace("\\\n", " ").splitlines():
                command = command.split("  #")[0].strip()
                if command.startswith("slackswap fit "):
                    found.append((page.name, command))
    return found


@pytest.mark.slow
@pytest.mark.parametrize("page, command", fit_commands())
def test_every_fit_command_of_the_docs_runs_as_written(page, command, tmp_path, monkeypatch):
    import shlex

    pytest.importorskip("transformers")
    from slackswap.cli import main

    # paths into the repository (a config.json) as from its root; what it writes goes to tmp
    argv = [str(ROOT / a) if (ROOT / a).is_file() else a for a in shlex.split(command)[1:]]
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 0, (page, command)
