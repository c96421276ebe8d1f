"""The device benchmarks' offline helpers, on synthetic inputs (CPU only)."""

import csv
import io
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import sass_partitions  # noqa: E402

_COLUMNS = [
    "Address",
    "Source",
    "Warp Stall Sampling (All Samples)",
    "Instructions Executed",
    "L2 Theoretical Sectors Local",
    "stall_long_sb",
    "stall_wait",
    "stall_long_sb (Not Issued)",
]


def _ncu_csv(tmp_path: Path, rows: list[tuple[str, str, int, int, int, int]]) -> Path:
    """ncu's source-page CSV: a kernel-name line, the header, one line per SASS instruction."""
    text = io.StringIO()
    text.write('"Kernel Name","_mla_decode_gluon_kernel",\n')
    writer = csv.writer(text, quoting=csv.QUOTE_ALL)
    writer.writerow(_COLUMNS)
    for address, source, samples, executed, sectors, long_sb in rows:
        writer.writerow([address, source, samples, f"{executed:,}", sectors, long_sb, samples - long_sb, 0])
    path = tmp_path / "src.csv"
    path.write_text(text.getvalue())
    return path


def test_instructions_are_counted_per_warp_specialized_partition(tmp_path):
    path = _ncu_csv(
        tmp_path,
        [
            ("0x00", "      LDC R1, c[0x0][0x28]", 1, 10, 0, 0),
            ("0x10", "      USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xa8", 0, 4, 0, 0),
            ("0x20", "      HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24", 5, 7, 0, 3),
            ("0x30", "      USETMAXREG.DEALLOC.CTAPOOL 0xe8", 0, 4, 0, 0),
            ("0x40", "  @!P0 LDL.64 R198, [R1+0x30]", 8, 100, 800, 6),
            ("0x50", "      STL [R1+0xcc], R14", 2, 40, 160, 0),
            ("0x60", "      LDG.E.128 R4, desc[UR6][R2.64]", 3, 9, 0, 3),
        ],
    )
    parts, spills = sass_partitions.partitions(sass_partitions.read_rows(path))
    assert [p.name for p in parts] == ["prologue", "try_alloc 168 regs @0x10", "dealloc 232 regs @0x30"]
    softmax = parts[2]
    assert (softmax.spill_loads, softmax.spill_stores, softmax.local_sectors) == (100, 40, 960)
    assert (softmax.global_loads, softmax.executed, softmax.samples) == (9, 153, 13)
    assert softmax.stalls["long_sb"] == 9 and "long_sb (Not Issued)" not in softmax.stalls
    assert parts[1].mmas == 7 and parts[1].spill_loads == 0
    assert sorted(executed for executed, *_ in spills) == [40, 100]
    # each instruction's stall samples and its largest reason, for the most stalled list
    assert sorted(softmax.stalled, reverse=True) == [
        (8, "@!P0 LDL.64 R198, [R1+0x30]", "long_sb"),
        (3, "LDG.E.128 R4, desc[UR6][R2.64]", "long_sb"),
        (2, "STL [R1+0xcc], R14", "wait"),
    ]


def test_the_report_lists_the_most_stalled_instructions_of_busy_partitions(tmp_path, capsys):
    path = _ncu_csv(
        tmp_path,
        [
            ("0x10", "      USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xa8", 0, 4, 0, 0),
            ("0x20", "      HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24", 1, 7, 0, 0),
            ("0x30", "      USETMAXREG.DEALLOC.CTAPOOL 0xe8", 0, 4, 0, 0),
            ("0x40", "      LDL.64 R198, [R1+0x30]", 30, 100, 800, 25),
            ("0x50", "      FMUL R4, R4, R5", 10, 40, 0, 0),
        ],
    )
    sass_partitions.report(path, top=1, stalled=1)
    text = capsys.readouterr().out
    # the 168-register partition holds 1 of 41 samples (< 10%): no list of its own
    assert "most stalled instructions of dealloc 232 regs @0x30 (of 40 samples)" in text
    assert "| 30 | `LDL.64 R198, [R1+0x30]` | long_sb |" in text
    assert "FMUL" not in text.split("most stalled")[1] and "most stalled instructions of try_alloc" not in text


def test_every_fp8_converter_variant_edits_the_bundled_fp8_modules_once():
    """fp8_converter_variants.py times text edits of generated modules (and of the runtime they import); a change
    that moves an edited line must fail here, not at the device."""
    import fp8_converter_variants

    root = Path(__file__).resolve().parent.parent / "generated"
    for module in ("deepseek_v3_tp8_fp8.py", "mistral_small_4_fp8.py"):
        source = (root / module).read_text()
        for name, (_, edits) in fp8_converter_variants.VARIANTS.items():
            assert edits, name
            sources = fp8_converter_variants.apply_edits(source, edits, name)  # each text found once, in turn
            assert sources != {"module": source, **fp8_converter_variants.host_sources()}, name


def test_module_edits_must_match_once_and_variants_must_exist(tmp_path):
    """A module edit that matches zero or two times, or an unknown variant name, is a ValueError naming it;
    a clean edit gives an imported copy with the replacement."""
    import types

    import fp8_converter_variants

    path = tmp_path / "generated_like.py"
    path.write_text("VALUE = 1\nOTHER = 1\n")
    module = types.SimpleNamespace(__file__=str(path))
    copy = fp8_converter_variants.edited_module(module, [("VALUE = 1", "VALUE = 2")], tmp_path, "edit")
    assert (copy.VALUE, copy.OTHER) == (2, 1)
    with pytest.raises(ValueError, match="expected one 'MISSING' .* found 0"):
        fp8_converter_variants.edited_module(module, [("MISSING", "x")], tmp_path, "missing")
    with pytest.raises(ValueError, match="found 2"):
        fp8_converter_variants.edited_module(module, [(" = 1\n", " = 3\n")], tmp_path, "twice")
    with pytest.raises(ValueError, match=r"unknown \['no_such_variant'\]"):
        fp8_converter_variants.variant_module(module, ["no_such_variant"], tmp_path)


def test_the_block_size_probe_edits_a_bundled_16_bit_module_once():
    """block_n_probe.py lets a caller's configuration take 128 cache positions a block by a text edit of a generated
    module (whose long blocks give P's layout); a template change that moves the edited line must fail here."""
    import block_n_probe

    source = (Path(__file__).resolve().parent.parent / "generated" / "mistral_small_4.py").read_text()
    for text, replacement in block_n_probe.EDITS:
        assert source.count(text) == 1, text
        source = source.replace(text, replacement)
    assert "DECODE_GLUON_SPACE = ((128, 200, 2)" in source and "DECODE_GLUON_LONG_BLOCK_N = 128" in source


def test_the_block_size_probe_names_a_malformed_configuration():
    import block_n_probe

    assert block_n_probe.parse_configs("auto,64:200:2") == [None, (64, 200, 2)]
    for bad in ("64:200", "64:x:2", "", "auto,128:200:2:1"):
        with pytest.raises(ValueError, match="--configs: expected 'auto' or block_n:registers:stages"):
            block_n_probe.parse_configs(bad)
