"""``benchmarks.benchmark_schedule --parts``: a copy per quantity of the "norms" preset."""


def test_the_benchmark_times_each_quantity_of_the_preset_alone(capsys):
    from benchmarks.benchmark_schedule import PARTS, main

    result = main(["--steps", "2", "--warmup", "0", "--micro-batch", "2", "--max-batch", "4",
                   "--patience", "1", "--clock", "wall", "--parts"])
    assert set(result["parts"]) == set(PARTS) and all(ratio > 0 for ratio in result["parts"].values())
    assert "each alone at the same batches / plain: TwoBatchNoiseScale" in capsys.readouterr().out
