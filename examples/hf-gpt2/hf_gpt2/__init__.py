"""hf-gpt2: A Hugging Face GPT2LMHeadModel (tied head) on Tiny Shakespeare, FedAvg or fedlmc's AlignedFedAvg."""
