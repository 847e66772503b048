"""flowertune-template: A Flower / FlowerTune app.

Trimmed: the template reads an instruction data set from the hub (``FederatedDataset``) with the
model's hub tokenizer. Here the instructions are the second half of the shipped Tiny Shakespeare (the
half the base never saw): each speech is a pair, "the speaker" → "the speech", IID-partitioned by
flwr-datasets' ``IidPartitioner``; the tokenizer is the base's character vocabulary. The prompt keeps
the template's shape with markers written in that vocabulary (it has no ``#``).
"""

from datasets import Dataset
from flwr_datasets.partitioner import IidPartitioner
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from trl import DataCollatorForCompletionOnlyLM

from fedlmc.data import load
from fedlmc.data.text import speeches

FDS = None  # Cache the partitioner
RESPONSE = "\nRESPONSE:"


def formatting_prompts_func(example):
    """Construct prompts."""
    return [
        f"INSTRUCTION: {instruction}{RESPONSE} {response}"
        for instruction, response in zip(example["instruction"], example["response"])
    ]


def get_tokenizer_and_data_collator_and_propt_formatting(seq_length: int):
    """The base's character tokenizer (a fast tokenizer, one token a character), the collator that
    trains on the responses only, and the prompt formatting."""
    chars = load("shakespeare").meta["chars"]
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token=" "))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=seq_length, padding_side="right")
    tokenizer.pad_token = tokenizer.eos_token = "$"  # a character the text hardly uses
    response_template_ids = tokenizer.encode(RESPONSE, add_special_tokens=False)
    data_collator = DataCollatorForCompletionOnlyLM(response_template_ids, tokenizer=tokenizer)
    return tokenizer, data_collator, formatting_prompts_func


def instructions(part: str = "train") -> Dataset:
    """Each speech as an instruction (its speaker) and a response (its lines): of the fine-tuning half
    (``train``: the base pretrains on the first half of the training 90 %) or of the test 5 % (``test``)."""
    text = open(load("shakespeare").meta["source"], encoding="utf-8").read()
    lo, hi = (0.45, 0.9) if part == "train" else (0.95, 1.0)
    units = speeches(text)
    pairs = {"instruction": [], "response": []}
    for start, end, speaker in zip(units.starts, units.ends, units.labels):
        if speaker and start >= int(lo * len(text)) and end <= int(hi * len(text)):
            lines = text[start:end].strip().split("\n")[1:]
            pairs["instruction"].append(f"speak as {speaker}")
            pairs["response"].append(" ".join(lines))
    return Dataset.from_dict(pairs)


def load_data(partition_id: int, num_partitions: int, dataset_name: str):
    """Load partition data."""
    # Only initialize the partitioner once
    global FDS
    if FDS is None:
        FDS = IidPartitioner(num_partitions=num_partitions)
        FDS.dataset = instructions()
    return FDS.load_partition(partition_id)


def replace_keys(input_dict, match="-", target="_"):
    """Recursively replace match string with target string in dictionary keys."""
    new_dict = {}
    for key, value in input_dict.items():
        new_key = key.replace(match, target)
        if isinstance(value, dict):
            new_dict[new_key] = replace_keys(value, match, target)
        else:
            new_dict[new_key] = value
    return new_dict
