"""The grounding parsers on text as each model family writes it, whole, fenced, cut off and broken."""

import pytest

from batchvlm.models.base.grounding import (florence2_boxes, florence2_regions, internvl_boxes, json_objects,
                                            paligemma_boxes, qwen3_boxes, qwen3_points, qwen25_boxes, qwen25_points)


def close(got, want):
    assert len(got) == len(want), got
    for g, w in zip(got, want):
        assert g == pytest.approx(w, abs=1e-6), (got, want)


QWEN3_FENCED = """```json
[
\t{"bbox_2d": [100, 250, 400, 750], "label": "cat"},
\t{"bbox_2d": [500, 0, 1000, 1000], "label": "dog"}
]
```"""


def test_qwen3_fenced_and_bare():
    close(qwen3_boxes(QWEN3_FENCED), [(0.1, 0.25, 0.4, 0.75), (0.5, 0.0, 1.0, 1.0)])
    bare = '[{"bbox_2d": [10, 20, 30, 40], "label": "a"}]'
    close(qwen3_boxes(bare), [(0.01, 0.02, 0.03, 0.04)])
    close(qwen3_points('```json\n[\n  {"point_2d": [500, 125], "label": "cup"}\n]\n```'), [(0.5, 0.125)])


def test_qwen3_truncated_keeps_complete_objects():
    cut = QWEN3_FENCED[: QWEN3_FENCED.index('"dog"')]  # max_new_tokens hit inside the second object
    close(qwen3_boxes(cut), [(0.1, 0.25, 0.4, 0.75)])
    assert qwen3_boxes('```json\n[\n\t{"bbox_2d": [100, 2') == []
    assert qwen3_boxes("") == [] and qwen3_points("There is no cat in the image.") == []


def test_qwen3_malformed_objects_are_skipped_not_fatal():
    text = ('[{"bbox_2d": [1, 2, 3], "label": "short"}, {"bbox_2d": ["1", 2, 3, 4]}, '
            '{"bbox_2d": [1, 2, 3, 4,], "label": "trailing comma"}, {"bbox_2d": [true, 2, 3, 4]}, '
            '{"label": "a {brace} in a string", "bbox_2d": [0, 0, 1000, 500]}, {"point_2d": [5, 5]}]')
    close(qwen3_boxes(text), [(0.0, 0.0, 1.0, 0.5)])
    close(qwen3_points(text), [(0.005, 0.005)])


def test_qwen3_corners_in_any_order_and_out_of_range_values():
    close(qwen3_boxes('{"bbox_2d": [800, 900, 200, 100]}'), [(0.2, 0.1, 0.8, 0.9)])
    close(qwen3_boxes('{"bbox_2d": [-20, 500, 1200, 1000.5]}'), [(0.0, 0.5, 1.0, 1.0)])
    close(qwen3_points('{"point_2d": [1001, -3]}'), [(1.0, 0.0)])


def test_nested_and_single_objects():
    text = 'Sure! {"bbox_2d": [0, 0, 10, 10], "label": "x"} and {"result": {"bbox_2d": [10, 10, 20, 20]}}'
    assert [o.get("label") for o in json_objects(text)] == ["x", None]
    close(qwen3_boxes(text), [(0.0, 0.0, 0.01, 0.01)])  # only top-level objects carry boxes
    broken_outer = '{"a": [1, 2, {"bbox_2d": [0, 0, 1000, 1000]}}'  # outer does not parse, inner does
    close(qwen3_boxes(broken_outer), [(0.0, 0.0, 1.0, 1.0)])


def test_qwen25_absolute_pixels_of_the_resized_image():
    text = '```json\n[\n\t{"bbox_2d": [56, 28, 280, 196], "label": "cat"}\n]\n```'
    close(qwen25_boxes(text, 560, 392), [(0.1, 28 / 392, 0.5, 0.5)])
    close(qwen25_points('[{"point_2d": [140, 392], "label": "cat"}]', 560, 392), [(0.25, 1.0)])
    close(qwen25_boxes('[{"bbox_2d": [56, 28, 280, 196]}, {"bbox_2d": [0, 0, 99', 560, 392),
          [(0.1, 28 / 392, 0.5, 0.5)])


def test_florence2_loc_tokens():
    # <OD> / <OPEN_VOCABULARY_DETECTION> output: a phrase, then four bins per box.
    close(florence2_boxes("car<loc_52><loc_334><loc_932><loc_774>"),
          [(0.0525, 0.3345, 0.9325, 0.7745)])
    two = "door<loc_100><loc_200><loc_300><loc_400><loc_500><loc_600><loc_700><loc_800>wheel<loc_0><loc_0><loc_999><loc_999>"
    close(florence2_boxes(two), [(0.1005, 0.2005, 0.3005, 0.4005), (0.5005, 0.6005, 0.7005, 0.8005),
                                 (0.0005, 0.0005, 0.9995, 0.9995)])
    poly = "car<poly><loc_10><loc_20><loc_50><loc_20><loc_50><loc_60><loc_10><loc_60></poly>"
    close(florence2_boxes(poly), [(0.0105, 0.0205, 0.0505, 0.0605)])


def test_florence2_truncated_and_malformed():
    close(florence2_boxes("car<loc_52><loc_334><loc_932><loc_774>car<loc_1><loc_2>"),
          [(0.0525, 0.3345, 0.9325, 0.7745)])
    close(florence2_boxes("car<loc_10><loc_20><loc_30><loc_40><loc_50><loc_60>"), [(0.0105, 0.0205, 0.0305, 0.0405)])
    close(florence2_boxes("car<poly><loc_10><loc_20><loc_30><loc_40></poly>"), [(0.0105, 0.0205, 0.0305, 0.0405)])
    close(florence2_boxes("car<poly><loc_10><loc_20><loc_30><loc_40><loc_50><loc_5><loc_7>"),
          [(0.0105, 0.0055, 0.0505, 0.0405)])  # cut inside a point: the complete points count
    assert florence2_boxes("car<loc_52><loc_334><loc_") == [] and florence2_boxes("a car") == []
    assert florence2_boxes("<loc_1><loc_2><loc_3><loc_4>") == []  # no phrase: not an object (the processor's rule)
    close(florence2_boxes("x<loc_1500><loc_0><loc_10><loc_10>"), [(0.0105, 0.0005, 1.0, 0.0105)])


def test_florence2_regions_keep_their_phrases():
    text = "</s><s>a red car<loc_52><loc_334><loc_932><loc_774>wheel<loc_0><loc_0><loc_9><loc_9><loc_5><loc_5>"
    got = florence2_regions(text)
    assert [label for label, _ in got] == ["a red car", "wheel"]
    close([box for _, box in got], [(0.0525, 0.3345, 0.9325, 0.7745), (0.0005, 0.0005, 0.0095, 0.0095)])
    assert florence2_regions("caf\u00e9 sign<loc_1><loc_2><loc_3><loc_4>")[0][0] == "caf sign"  # ASCII only, as upstream


def test_paligemma_yx_order_1024_bins():
    text = "<loc0256><loc0128><loc0768><loc0512> cat ; <loc0000><loc0000><loc1023><loc1023> cat"
    close(paligemma_boxes(text), [(0.125, 0.25, 0.5, 0.75), (0.0, 0.0, 1023 / 1024, 1023 / 1024)])


def test_paligemma_truncated_and_malformed():
    close(paligemma_boxes("<loc0256><loc0128><loc0768><loc0512> cat ; <loc0001><loc0002>"),
          [(0.125, 0.25, 0.5, 0.75)])
    assert paligemma_boxes("<loc256><loc0128><loc0768><loc0512> cat") == []  # three digits: not a bin
    assert paligemma_boxes("no objects") == []


def test_internvl_boxes():
    text = "<ref>the dog</ref><box>[[100, 200, 300, 400], [500, 500, 1000, 1000]]</box>"
    close(internvl_boxes(text), [(0.1, 0.2, 0.3, 0.4), (0.5, 0.5, 1.0, 1.0)])
    close(internvl_boxes("<ref>cat</ref><box>[[12.5, 0, 250, 999]]</box>"), [(0.0125, 0.0, 0.25, 0.999)])


def test_internvl_truncated_and_malformed():
    close(internvl_boxes("<ref>dog</ref><box>[[100, 200, 300, 400], [500, 500, 10"), [(0.1, 0.2, 0.3, 0.4)])
    assert internvl_boxes("<box>[[1, 2, 3]]</box>") == [] and internvl_boxes("[[a, b, c, d]]") == []
