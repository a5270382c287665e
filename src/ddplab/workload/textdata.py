"""Byte-level next-token data for the language-model workload (``data.dataset: tokens``).

Every byte is a token (vocabulary 256), so any text works without a tokenizer and nothing is
downloaded. A sample is ``seq_len`` bytes and the same bytes shifted by one (the targets).
The text is a file, every text file under a folder (sorted, so the order is the same on every
rank and machine), or, when ``data.root`` is '', generated from the seed.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import Dataset

VOCAB_SIZE = 256
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".yaml", ".yml")
EVAL_FRACTION = 0.1
"""The last tenth of the text is held out for evaluation."""


class ByteTokens(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Non-overlapping windows of ``seq_len + 1`` bytes: (input, next-token targets)."""

    def __init__(self, data: torch.Tensor, seq_len: int) -> None:
        self.data, self.seq_len = data, seq_len
        self.vocab_size = VOCAB_SIZE

    def __len__(self) -> int:
        return max((len(self.data) - 1) // self.seq_len, 0)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.seq_len: (i + 1) * self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]


def text_files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)


def read_text(root: Path) -> bytes:
    return b"\n".join(p.read_bytes() for p in text_files(root))


def min_bytes(seq_len: int) -> int:
    """The shortest text that gives one evaluation sample and ten training samples."""
    return int((seq_len + 1) / EVAL_FRACTION) + seq_len + 1


def generated(n_bytes: int, seed: int) -> bytes:
    """Learnable text from the seed: words of a made-up lexicon, each followed by one of three
    successors (a sparse Markov chain), so a model has structure to find at every scale."""
    g = torch.Generator().manual_seed(seed)
    letters = b"abcdefghijklmnopqrstuvwxyz"
    lexicon = []
    for _ in range(200):
        n = int(torch.randint(2, 9, (1,), generator=g))
        lexicon.append(bytes(letters[int(i)] for i in torch.randint(26, (n,), generator=g)))
    successors = torch.randint(len(lexicon), (len(lexicon), 3), generator=g)
    out, word, size = bytearray(), 0, 0
    while size < n_bytes:
        piece = lexicon[word] + (b".\n" if int(torch.randint(12, (1,), generator=g)) == 0 else b" ")
        out += piece
        size += len(piece)
        word = int(successors[word, int(torch.randint(3, (1,), generator=g))])
    return bytes(out[:n_bytes])


def datasets(root: str, seq_len: int, train_samples: int, eval_samples: int,
             seed: int) -> tuple[ByteTokens, ByteTokens]:
    """Train on the first 90% of the text, evaluate on the rest; generated text when root is ''."""
    if root:
        text = read_text(Path(root))
        cut = len(text) - int(len(text) * EVAL_FRACTION)
        train, evals = text[:cut], text[cut:]
    else:
        train = generated(train_samples * seq_len + 1, seed)
        evals = generated(eval_samples * seq_len + 1, seed + 7_919)
    as_tensor = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8)  # noqa: E731
    return ByteTokens(as_tensor(train), seq_len), ByteTokens(as_tensor(evals), seq_len)


def problem(root: str, seq_len: int) -> str:
    """Why ``root`` cannot give token data, or ''."""
    if not root:
        return ""
    path = Path(root)
    if not path.exists():
        return (f"no such file or folder ({path.resolve()}); give a text file, a folder of "
                f"{'/'.join(TEXT_SUFFIXES)} files, or '' for generated text")
    files = text_files(path)
    if not files:
        return f"{path.resolve()} holds no {'/'.join(TEXT_SUFFIXES)} files"
    size = sum(p.stat().st_size for p in files)
    if size < min_bytes(seq_len):
        return (f"{size} bytes of text is too short for data.seq_len {seq_len}: give at least "
                f"{min_bytes(seq_len)} bytes, or a smaller data.seq_len")
    return ""
