from sparsegen.bench.stats import percentile


def test_percentile_is_the_nearest_rank_of_the_sorted_values():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 0.0) == 1.0
    assert percentile(values, 0.5) == 3.0
    assert percentile(values, 0.9) == 5.0  # rank round(0.9 * 4) = 4
    assert percentile(values, 0.6) == 3.0  # rank round(2.4) = 2: no interpolation toward 4
    assert percentile([7.0], 0.9) == 7.0
