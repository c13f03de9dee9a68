"""LlamaGen's caption cleaning, against outputs of the official function.

Expected outputs: ``T5Embedder.text_preprocessing`` (``clean_caption`` applied twice) from
FoundationVision/LlamaGen ``language/t5.py``, run with ftfy 6.3.1 and beautifulsoup4 4.15.0 on
each input below.
"""

import pytest

from sjd_core.models.llamagen_caption import clean_caption

OFFICIAL = [
    ("A Portrait Photo of a Kangaroo wearing an orange hoodie and blue sunglasses",
     "a portrait photo of a kangaroo wearing an orange hoodie and blue sunglasses"),
    ("A photo of a cat, see https://example.com/cats/tabby.html for more",
     "a photo of a cat, see html for more"),
    ("<b>Bold</b> red fox &amp; a hound in the <i>snow</i>",
     "bold red fox a hound in the snow"),
    ("a watercolor of a lighthouse by @artist123 at dusk",
     "a watercolor of a lighthouse by at dusk"),
    ("“Quoted” words, ‘single’ quotes — and an en–dash",
     "\"quoted\" words, 'single' quotes - and an en-dash"),
    ("this_is_my_cute_cat_in_the_garden",
     "this is my cute cat in the garden"),
    ("Sunset over mountains... 4k, ultra detailed!!! (masterpiece) [best quality]",
     "sunset over mountains 4k, ultra detailed!!! masterpiece best quality"),
    ("A blue Porsche 356 parked in front of a yellow brick wall.",
     "a blue porsche 356 parked in front of a yellow brick wall."),
    ("ﬁne café in Zürich 猫 at night, Ｆｕｌｌｗｉｄｔｈ text",
     "fine café in zürich at night, fullwidth text"),
    ("free shipping!!! IMG_1234.jpg wallpaper 1920x1080 photo #12 page 3",
     "!!! wallpaper photo"),
    ("an astronaut riding a horse\\non the moon, 8k",
     "an astronaut riding a horse on the moon, 8k"),
    ("A dog's \"toy\" at 192.168.0.1 with code jc6640 and 2x3 grid",
     "a dog's \"toy\" at with code and grid"),
    ("Tom &amp; Jerry at AT&T",
     "tom jerry at att"),
    ("<script>alert(1)</script> a <template>hidden</template>text",
     "a text"),
    ("„German quotes‟ ‹and› ‚these‛",
     "german quotes\" ‹and› 'these"),
]


@pytest.mark.parametrize("caption, cleaned", OFFICIAL)
def test_caption_is_cleaned_as_the_official_pipeline_does(caption, cleaned):
    assert clean_caption(caption) == cleaned
