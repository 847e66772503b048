"""Merging models once they are aligned: averages (weighted, masked, circuit, robust), the universe of many
models, widths, distillation toward an ensemble, barriers, screening of outlier replies."""
