"""flowertune-template: Flower's FlowerTune template, trimmed to a local tiny GPT-2, with fedlmc's LoraFedAvg."""
