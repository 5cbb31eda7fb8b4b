"""``draftsmith data show``: one record of a data file as a recipe trains on it, token by token.

    draftsmith data show chat.jsonl --target Qwen/Qwen3-8B --format messages --schema sharegpt --index 3
    draftsmith data show chat.jsonl --target testbed --format prompt_response --json

The record is read and encoded exactly as ``data:`` with the same keys would (:func:`distill.data.encode_example`,
the target's chat template with ``--chat-template-kwargs``); each training example it makes is printed
as one line per token: its position, its mask bit (1: the loss scores it), its id and its text. Tokens
past ``--seq-len + 1`` are marked ``cut``: a training window drops them. ``--json`` prints a list per
example of ``{"id", "token", "mask"}``.
"""

from __future__ import annotations

import json
from pathlib import Path


def add_arguments(parser) -> None:
    parser.add_argument("file", metavar="FILE", help="a .jsonl / .json / .parquet data file")
    parser.add_argument("--target", required=True, help="'testbed', a local folder or a hub id: its tokenizer")
    parser.add_argument(
        "--format", default="messages", choices=["messages", "prompt_response"], help="data.format (default: messages)"
    )
    parser.add_argument(
        "--schema", default="openai", choices=["openai", "sharegpt", "ultrachat"], help="data.chat_schema"
    )
    parser.add_argument("--field", help="data.messages_field (default: the schema's)")
    parser.add_argument("--turns", default="all", choices=["all", "last"], help="data.assistant_turns (default: all)")
    parser.add_argument(
        "--chat-template-kwargs",
        type=json.loads,
        default={},
        metavar="JSON",
        help="target.chat_template_kwargs, e.g. '{\"enable_thinking\": false}'",
    )
    parser.add_argument("--seq-len", type=int, default=2048, help="data.seq_len: the training window (default: 2048)")
    parser.add_argument("--index", type=int, default=0, metavar="I", help="the record (default: 0)")
    parser.add_argument("--json", action="store_true", help="print JSON: per example a list of {id, token, mask}")


def examples(args) -> tuple[list[list[dict]], int]:
    """The record's training examples as ``{"id", "token", "mask"}`` lists, and the number of records."""
    from transformers import AutoTokenizer

    from distill.chat import ConversationError
    from distill.config import DataConfig, RecipeError
    from distill.data import encode_example, load_text_splits
    from distill.models import resolve_target_path

    try:
        cfg = DataConfig(
            source="files",
            train_files=[args.file],
            val_files=[args.file],
            format=args.format,
            chat_schema=args.schema,
            messages_field=args.field,
            assistant_turns=args.turns,
            seq_len=args.seq_len,
        )
    except ValueError as e:
        raise RecipeError(str(e).splitlines()[-1].strip()) from None
    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()  # one small file: no bars
    records = load_text_splits(cfg).train
    if not 0 <= args.index < len(records):
        raise RecipeError(f"--index {args.index}: {args.file} holds records 0..{len(records) - 1}")
    tokenizer = AutoTokenizer.from_pretrained(resolve_target_path(args.target))
    try:
        encoded = encode_example(records[args.index], tokenizer, cfg, args.chat_template_kwargs)
    except (ConversationError, KeyError) as e:
        raise RecipeError(f"{args.file} record {args.index}: {e}") from None
    shown = [[{"id": t, "token": tokenizer.decode([t]), "mask": m} for t, m in zip(ids, mask)] for ids, mask in encoded]
    return shown, len(records)


def main(args) -> int:
    shown, count = examples(args)
    if args.json:
        print(json.dumps(shown, ensure_ascii=False))
        return 0
    window = args.seq_len + 1
    print(
        f"{Path(args.file).name} record {args.index} of {count} ({args.format}, {args.schema}): "
        f"{len(shown)} training example(s)"
    )
    for e, rows in enumerate(shown, 1):
        scored = sum(r["mask"] for r in rows)
        print(f"\n-- example {e}/{len(shown)}: {len(rows)} tokens, {scored} scored --")
        print(f"{'pos':>5} mask {'id':>7}  token")
        for k, r in enumerate(rows):
            flag = "cut" if k >= window else f"{r['mask']:>4}"
            print(f"{k:>5} {flag:>4} {r['id']:>7}  {r['token']!r}")
    return 0
