"""hf-vit: A Hugging Face ViTForImageClassification on scikit-learn's digits, FedAvg or fedlmc's AlignedFedAvg."""
