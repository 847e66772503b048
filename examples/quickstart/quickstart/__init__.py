"""quickstart: a Flower app whose server swaps FedAvg for fedlmc's AlignedFedAvg."""
