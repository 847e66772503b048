"""flowertune-gpt2: FlowerTune-style LoRA fine-tuning of a Hugging Face GPT-2 with PEFT, FedAvg or LoraFedAvg."""
