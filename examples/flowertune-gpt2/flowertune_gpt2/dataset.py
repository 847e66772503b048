"""The data: the second half of Tiny Shakespeare's training text (the half the base never saw), dealt
out to the clients by speaking character or IID, and the test split."""

from fedlmc.hf.pretrained import finetune_partitions, pretrain_and_finetune_text


def load_data(partition_id: int, num_partitions: int, partitioner: str):
    return finetune_partitions(num_partitions, partitioner, seed=0)[partition_id]


def load_test():
    return pretrain_and_finetune_text()[2]
