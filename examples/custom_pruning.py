"""A pruning method of your own, in one file: RIA (Zhang et al., "Plug-and-Play: An Efficient Post-training Pruning
Method for Large Language Models", ICLR 2024). A weight's score is its relative importance within its row and within
its column, times its input's norm to the power 0.5; scores are compared within each output row. Registered, it is
a method like the built-in ones:

    python examples/custom_pruning.py
    sparsegen --plugin examples/custom_pruning.py prune --model smollm2 --method ria --pattern 2:4 --out DIR
"""

import torch

from sparsegen.pruning import PruningMethod, register_pruning_method


@register_pruning_method
class RIA(PruningMethod):
    name = "ria"
    statistic = "norms"  # each input column's sum of squares over the calibration tokens
    per_row = True

    def scores(self, weight: torch.Tensor, stats) -> torch.Tensor:
        size = weight.abs().float()
        relative = size / size.sum(1, keepdim=True) + size / size.sum(0, keepdim=True)
        return relative * stats.sq_sum.float().sqrt().pow(0.5)[None, :]


if __name__ == "__main__":
    import sparsegen
    from sparsegen.data import data_dir, tokenize_files
    from sparsegen.models.calibration import calibration_ids

    model, tokenizer = sparsegen.load("reference")
    books = tokenize_files(data_dir() / "books" / "train", tokenizer)
    ids = calibration_ids(books, nsamples=8, seqlen=128, seed=0, bos_id=tokenizer.bos_token_id)
    report = sparsegen.prune_model(model, sparsegen.PruneConfig("ria", pattern="2:4", nsamples=8, seqlen=128), ids,
                                   progress=False)
    print(f"ria 2:4: {report['achieved']:.3f} of {report['pruned_params']:,} weights are zero")
