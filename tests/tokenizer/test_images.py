"""Image parts in the tokenizer service: Kimi K2.5's resize, placeholder expansion through the real
gRPC servicer, the caps and every bad image named by its part. Nothing here reaches beyond 127.0.0.1."""

from __future__ import annotations

import ast
import asyncio
import base64
import io
import itertools
import json
import math
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import transformers
from metrics_scrape import exposition, naming_problems
from PIL import Image

from cachet.common.v1 import common_pb2
from cachet.errors import InvalidArgument, error_info_from_metadata
from cachet.grpc_channel import create_channel
from cachet.grpc_server import RunningServer, create_server
from cachet.models.tiny import write_tiny_model
from cachet.tokenizer.image_cache import PreparedImageCache
from cachet.tokenizer.images import ImageLimits, decode_rgb, image_bytes, navit_size, resized_input
from cachet.tokenizer.main import start
from cachet.tokenizer.model_info import SpecialToken, VisionInfo, vision_info
from cachet.tokenizer.model_registry import ModelRegistry
from cachet.tokenizer.servicer import SERVICE_NAME, TokenizerServicer
from cachet.tokenizer.settings import TokenizerSettings
from cachet.tokenizer.tokenizer_model import TokenizerModel
from cachet.tokenizer.v1 import tokenizer_pb2 as pb
from cachet.tokenizer.v1 import tokenizer_pb2_grpc

VISION_MODEL_ID = "tiny-kimi-vision"
TEXT_MODEL_ID = "tiny-kimi-text"
K25 = VisionInfo(
    placeholder_token_id=0,
    placeholder_text="",
    patch_size=14,
    merge_kernel=(2, 2),
    max_patches=16384,
    max_patches_per_side=512,
)
MARKUP = "<|media_start|>image<|media_content|><|media_pad|><|media_end|>"


# --- transformers' navit_resize, read from its source: its module imports torchvision, which
# --- this venv lacks (beside torch 2.13), so the function is compiled on its own.


def _transformers_navit_resize() -> Callable[..., Any]:
    source = Path(transformers.__file__).parent / "models/kimi_k25/image_processing_kimi_k25.py"
    tree = ast.parse(source.read_text())
    function = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "navit_resize")
    namespace: dict[str, Any] = {"math": math}
    exec(compile(ast.Module(body=[function], type_ignores=[]), str(source), "exec"), namespace)  # noqa: S102
    return namespace["navit_resize"]


SIZES = [
    (1, 1), (1, 5000), (5000, 1), (13, 13), (14, 14), (15, 29), (27, 28), (28, 28), (29, 57),
    (100, 100), (480, 640), (720, 1280), (1080, 1920), (1792, 1792), (1793, 1791), (2000, 3000),
    (4000, 3000), (7168, 7168), (7169, 20), (20, 7169), (10000, 10000), (100, 30000), (30000, 100),
    (16384, 14), (14, 16384 * 14), (3, 100000), (12345, 6789), (2, 3), (60, 40),
]  # fmt: skip


@pytest.mark.parametrize("budget", [(16384, 512), (64, 16), (4096, 30)])
def test_resize_sizes_equal_transformers_navit_resize(budget: tuple[int, int]) -> None:
    reference = _transformers_navit_resize()
    max_patches, per_side = budget
    vision = VisionInfo(0, "", 14, (2, 2), max_patches, per_side)
    rng = np.random.default_rng(0)
    random_sizes = [tuple(int(v) for v in rng.integers(1, 9000, size=2)) for _ in range(300)]
    for height, width in SIZES + random_sizes:
        expected = reference(height, width, 14, 2, max_patches, per_side)
        assert navit_size(height, width, vision) == tuple(map(tuple, expected)), (height, width)


def _random_image(height: int, width: int, seed: int = 0) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


@pytest.mark.parametrize("size", [(60, 40), (37, 301), (900, 700), (2000, 120), (28, 56)])
def test_resized_pixels_equal_transformers(size: tuple[int, int]) -> None:
    height, width = size
    image = _random_image(height, width)
    # A small budget so that most of these are scaled down.
    vision = VisionInfo(0, "", 14, (2, 2), 256, 64)
    result = resized_input(image, vision)
    padded_h, padded_w = result.grid_height * 14, result.grid_width * 14
    ours = np.frombuffer(result.pixels, dtype=np.uint8).reshape(padded_h, padded_w, 3)
    (resized_h, resized_w), _ = navit_size(height, width, vision)
    try:
        from transformers.models.kimi_k25.image_processing_kimi_k25 import Kimi_K25ImageProcessor
    except ImportError:
        # No torchvision: compare with transformers' PIL path (image_transforms.resize, bicubic)
        # and its zero padding instead of the torchvision processor.
        from transformers.image_transforms import resize
        from transformers.image_utils import ChannelDimension, PILImageResampling

        expected = resize(
            np.asarray(image),
            (resized_h, resized_w),
            resample=PILImageResampling.BICUBIC,
            input_data_format=ChannelDimension.LAST,
            data_format=ChannelDimension.LAST,
        )
        expected = np.pad(expected, ((0, padded_h - resized_h), (0, padded_w - resized_w), (0, 0)))
        assert np.array_equal(ours, expected)
        return
    processor = Kimi_K25ImageProcessor(max_patches=256, size={"max_height": 64, "max_width": 64})
    out = processor(images=[image], return_tensors="np")
    assert out["image_grid_thw"].tolist() == [[1, result.grid_height, result.grid_width]]
    # The processor's layout: [patches, 3, 14, 14], normalised with mean = std = 0.5.
    patches = ours.reshape(result.grid_height, 14, result.grid_width, 14, 3).transpose(0, 2, 4, 1, 3)
    normalised = (patches.reshape(-1, 3, 14, 14) / 255.0 - 0.5) / 0.5
    # torchvision's uint8 bicubic may round a pixel one step off Pillow's.
    assert np.abs(normalised - out["pixel_values"]).max() <= 2 / 255 + 1e-6


def test_grid_and_tokens_of_a_small_image() -> None:
    result = resized_input(_random_image(40, 60), K25)
    # 40x60 is kept, then padded to 56x84: a 4x6 patch grid, 6 merged tokens.
    assert (result.grid_height, result.grid_width, result.num_tokens) == (4, 6, 6)
    pixels = np.frombuffer(result.pixels, dtype=np.uint8).reshape(56, 84, 3)
    assert np.array_equal(pixels[:40, :60], np.asarray(_random_image(40, 60)))
    assert not pixels[40:].any() and not pixels[:, 60:].any()


# --- through the real gRPC servicer, on a model directory with a vision config


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny kimi-k2 checkpoint's tokenizer (its vocabulary has K2's media tokens) and template."""
    return write_tiny_model(tmp_path_factory.mktemp("kimi-vision") / "k2", family="kimi-k2")


@pytest.fixture(scope="module")
def vision_dir(kimi_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """kimi_dir's tokenizer with a kimi_k25-style config.json: a vision_config, the placeholder id."""
    target = tmp_path_factory.mktemp("kimi-vision") / VISION_MODEL_ID
    target.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (kimi_dir / name).is_file():
            (target / name).write_bytes((kimi_dir / name).read_bytes())
    vocab = json.loads((kimi_dir / "tokenizer.json").read_text())
    pad_id = next(t["id"] for t in vocab["added_tokens"] if t["content"] == "<|media_pad|>")
    text_config = json.loads((kimi_dir / "config.json").read_text())
    config = {
        "model_type": "kimi_k25",
        "text_config": text_config,
        "vision_config": {"patch_size": 14, "merge_kernel_size": [2, 2]},
        "media_placeholder_token_id": pad_id,
    }
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.fixture(scope="module")
def vision_model(vision_dir: Path) -> TokenizerModel:
    return TokenizerModel.load(VISION_MODEL_ID, vision_dir)


@pytest.fixture(scope="module")
def text_model(kimi_dir: Path) -> TokenizerModel:
    return TokenizerModel.load(TEXT_MODEL_ID, kimi_dir)


class ImageServer:
    """An HTTP server on 127.0.0.1 that serves ``routes`` (path -> (status, headers, body))."""

    def __init__(self) -> None:
        self.routes: dict[str, tuple[int, dict[str, str], bytes]] = {}
        self.requests: list[str] = []
        routes, requests = self.routes, self.requests

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                requests.append(self.path)
                status, headers, body = routes.get(self.path, (404, {}, b""))
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if "X-Drip" not in headers:
                    self.wfile.write(body)
                    return
                try:
                    for byte in body:  # a byte at a time: every read is quick, the whole is slow
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                        time.sleep(0.05)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up at its deadline, as it should

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture(scope="module")
def image_server() -> Iterator[ImageServer]:
    server = ImageServer()
    yield server
    server.close()


LIMITS = ImageLimits(
    max_bytes=200_000,
    max_pixels=4_000_000,
    max_images=3,
    url_hosts=frozenset({"127.0.0.1"}),
    fetch_timeout_seconds=5,
)


@pytest.fixture
def image_cache() -> PreparedImageCache:
    """The servicer's prepared-image cache: a fresh one per test."""
    return PreparedImageCache()


@pytest.fixture
async def stub(
    vision_model: TokenizerModel, text_model: TokenizerModel, image_cache: PreparedImageCache
) -> AsyncIterator[tokenizer_pb2_grpc.TokenizerServiceStub]:
    servicer = TokenizerServicer(
        ModelRegistry([vision_model, text_model]),
        max_input_chars=1_000_000,
        image_limits=LIMITS,
        image_cache=image_cache,
    )
    running: RunningServer = await create_server(
        TokenizerSettings(port=0, models=[]), [servicer.register], [SERVICE_NAME]
    )
    async with create_channel(running.address) as channel:
        yield tokenizer_pb2_grpc.TokenizerServiceStub(channel)
    await running.stop(grace=None)


def png(image: Image.Image, format: str = "PNG") -> bytes:
    out = io.BytesIO()
    image.save(out, format=format)
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def text(value: str) -> common_pb2.ContentPart:
    return common_pb2.ContentPart(text=value)


def image(url: str) -> common_pb2.ContentPart:
    return common_pb2.ContentPart(image_url=url)


def request(
    *messages: common_pb2.ChatMessage, model: str = VISION_MODEL_ID, **fields: Any
) -> pb.ApplyChatTemplateRequest:
    return pb.ApplyChatTemplateRequest(model=model, messages=messages, add_generation_prompt=True, **fields)


def user(*parts: common_pb2.ContentPart) -> common_pb2.ChatMessage:
    return common_pb2.ChatMessage(role="user", content=parts)


SMALL = data_url(png(_random_image(40, 60, seed=1)))  # 6 tokens
TALL = data_url(png(_random_image(100, 30, seed=2)))  # 112x56: 8x4 patches, 8 tokens


async def test_placeholders_expand_at_each_images_place(
    stub: tokenizer_pb2_grpc.TokenizerServiceStub, vision_model: TokenizerModel
) -> None:
    reply = await stub.ApplyChatTemplate(
        request(
            common_pb2.ChatMessage(role="system", content=[text("Be brief.")]),
            user(text("Compare"), image(SMALL), text("with"), image(TALL)),
            prefix_message_counts=[1, 2],
        )
    )
    pad = vision_model.info.vision.placeholder_token_id  # type: ignore[union-attr]
    # The template got the content as a string, the markup between the text parts.
    assert f"Compare\n{MARKUP}\nwith\n{MARKUP}" in reply.prompt
    unexpanded = vision_model.encode(reply.prompt, add_special_tokens=False)
    assert [(i.num_tokens, i.grid_height, i.grid_width) for i in reply.images] == [(6, 4, 6), (8, 8, 4)]
    first, second = (unexpanded.index(pad), len(unexpanded) - 1 - unexpanded[::-1].index(pad))
    assert [i.token_offset for i in reply.images] == [first, second + 5]
    expected = (
        unexpanded[:first] + [pad] * 6 + unexpanded[first + 1 : second] + [pad] * 8 + unexpanded[second + 1 :]
    )
    assert list(reply.token_ids) == expected
    for item in reply.images:
        assert (
            list(reply.token_ids[item.token_offset : item.token_offset + item.num_tokens])
            == [pad] * item.num_tokens
        )
        assert len(item.pixels) == item.grid_height * 14 * item.grid_width * 14 * 3
    # The system turn's breakpoint is before any image; the user turn's covers both.
    system_only, with_user = reply.prefix_token_counts
    assert system_only < reply.images[0].token_offset
    alone = vision_model.encode(
        vision_model.apply_chat_template(
            [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": f"Compare\n{MARKUP}\nwith\n{MARKUP}"},
            ],
            [],
            add_generation_prompt=False,
            continue_final_message=False,
        ).prompt,
        add_special_tokens=False,
    )
    assert with_user == len(alone) + 5 + 7
    assert (
        list(reply.token_ids[:with_user])
        == alone[:first] + [pad] * 6 + alone[first + 1 : second] + [pad] * 8 + alone[second + 1 :]
    )


async def test_the_same_image_hashes_the_same_and_a_changed_pixel_differently(
    stub: tokenizer_pb2_grpc.TokenizerServiceStub,
) -> None:
    picture = _random_image(40, 60, seed=3)
    changed = picture.copy()
    changed.putpixel((59, 39), tuple(255 - v for v in picture.getpixel((59, 39))))  # type: ignore[union-attr, arg-type]
    reply = await stub.ApplyChatTemplate(
        request(user(image(data_url(png(picture))), image(data_url(png(picture, "WEBP"), "image/webp")))),
    )
    again = await stub.ApplyChatTemplate(request(user(text("again"), image(data_url(png(picture))))))
    other = await stub.ApplyChatTemplate(request(user(image(data_url(png(changed))))))
    first = reply.images[0].content_hash
    assert len(first) == 32 and again.images[0].content_hash == first
    assert other.images[0].content_hash != first
    # Lossy WebP changes pixels, so it is another image as far as the cache goes.
    assert reply.images[1].content_hash != first


async def test_an_allowed_url_is_fetched_once_from_the_local_server(
    stub: tokenizer_pb2_grpc.TokenizerServiceStub, image_server: ImageServer
) -> None:
    body = png(_random_image(40, 60, seed=1))
    image_server.routes["/small.png"] = (200, {"Content-Type": "image/png"}, body)
    fetched = await stub.ApplyChatTemplate(request(user(image(image_server.url("/small.png")))))
    inline = await stub.ApplyChatTemplate(request(user(image(SMALL))))
    assert fetched.images[0].content_hash == inline.images[0].content_hash
    assert list(fetched.token_ids) == list(inline.token_ids)


async def test_counting_through_the_template_counts_image_tokens(
    stub: tokenizer_pb2_grpc.TokenizerServiceStub, vision_model: TokenizerModel
) -> None:
    reply = await stub.ApplyChatTemplate(request(user(text("look"), image(TALL))))
    # CountTokens of a chat (the router's and the Anthropic count_tokens path) is len(token_ids):
    # the prompt's own tokens with the one placeholder standing for the image's 8.
    assert len(reply.token_ids) == len(vision_model.encode(reply.prompt, add_special_tokens=False)) + 8 - 1


class PillowOpens:
    """Counts ``Image.open`` calls: one per image decoded (the service runs in this process)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        original = Image.open

        def counting_open(*args: Any, **kwargs: Any) -> Image.Image:
            self.count += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(Image, "open", counting_open)


async def test_a_picture_sent_again_is_not_decoded_again(
    stub: tokenizer_pb2_grpc.TokenizerServiceStub,
    image_cache: PreparedImageCache,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    opens = PillowOpens(monkeypatch)
    first = await stub.ApplyChatTemplate(request(user(text("look"), image(TALL))))
    # The next turn: the whole conversation again, the picture at the same place and a new one after.
    again = await stub.ApplyChatTemplate(
        request(
            user(text("look"), image(TALL)),
            common_pb2.ChatMessage(role="assistant", content=[text("a tall picture")]),
            user(text("and this one?"), image(SMALL)),
        )
    )
    assert opens.count == 2  # TALL once, SMALL once
    assert (image_cache.figures.hits, image_cache.figures.misses) == (1, 2)
    kept, new = again.images
    assert kept.pixels == first.images[0].pixels and kept.content_hash == first.images[0].content_hash
    assert (kept.grid_height, kept.grid_width, kept.num_tokens) == (8, 4, 8)
    assert new.content_hash != kept.content_hash and new.num_tokens == 6
    # Each request got its own ImageInput: the second's placeholders start elsewhere.
    assert first.images[0].token_offset == kept.token_offset < new.token_offset
    # The same picture encoded otherwise is other bytes: decoded again.
    as_webp = data_url(png(_random_image(100, 30, seed=2), "WEBP"), "image/webp")
    await stub.ApplyChatTemplate(request(user(text("look"), image(as_webp))))
    assert opens.count == 3 and image_cache.figures.misses == 3
    image_cache.check_invariants()


async def test_a_url_is_fetched_every_time_and_decoded_once_per_content(
    stub: tokenizer_pb2_grpc.TokenizerServiceStub,
    image_cache: PreparedImageCache,
    image_server: ImageServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    opens = PillowOpens(monkeypatch)
    before = image_server.requests.count("/changing.png")
    image_server.routes["/changing.png"] = (200, {}, png(_random_image(40, 60, seed=5)))
    url = image_server.url("/changing.png")
    first = await stub.ApplyChatTemplate(request(user(image(url))))
    second = await stub.ApplyChatTemplate(request(user(image(url))))
    assert opens.count == 1 and second.images[0].pixels == first.images[0].pixels
    # What the URL names changes: the new content is decoded, never the old one served.
    image_server.routes["/changing.png"] = (200, {}, png(_random_image(40, 60, seed=6)))
    changed = await stub.ApplyChatTemplate(request(user(image(url))))
    assert opens.count == 2 and changed.images[0].content_hash != first.images[0].content_hash
    assert image_server.requests.count("/changing.png") - before == 3


async def test_count_only_returns_the_same_tokens_and_no_pixels(
    stub: tokenizer_pb2_grpc.TokenizerServiceStub,
) -> None:
    messages = (
        common_pb2.ChatMessage(role="system", content=[text("Be brief.")]),
        user(text("Compare"), image(SMALL), text("with"), image(TALL)),
    )
    full = await stub.ApplyChatTemplate(request(*messages, prefix_message_counts=[1, 2]))
    counted = await stub.ApplyChatTemplate(request(*messages, prefix_message_counts=[1, 2], count_only=True))
    assert list(counted.token_ids) == list(full.token_ids)
    assert list(counted.prefix_token_counts) == list(full.prefix_token_counts)
    assert counted.prompt == full.prompt
    assert all(item.pixels for item in full.images)
    assert [item.pixels for item in counted.images] == [b"", b""]
    without_pixels = [common_pb2.ImageInput() for _ in full.images]
    for target, item in zip(without_pixels, full.images, strict=True):
        target.CopyFrom(item)
        target.ClearField("pixels")
    assert list(counted.images) == without_pixels
    assert counted.ByteSize() < full.ByteSize() // 10


async def test_the_service_keeps_images_within_its_setting_and_counts_them_on_metrics(
    vision_dir: Path,
) -> None:
    # Room for one of TALL (112x56 pixels as resized) or SMALL (56x84), not both.
    settings = TokenizerSettings(port=0, models=[str(vision_dir)], image_cache_bytes=20_000)
    running = await start(settings, metrics_port=0)
    try:
        async with create_channel(running.address) as channel:
            service = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
            (model,) = (await service.ListModels(pb.ListModelsRequest())).models
            for picture in (TALL, TALL, SMALL, TALL):  # a hit, then each evicts the other
                await service.ApplyChatTemplate(request(user(image(picture)), model=model.model))
        assert running.metrics_port is not None
        exposed = await asyncio.to_thread(exposition, running.metrics_port)
    finally:
        await running.stop(grace=None)
    assert naming_problems(exposed) == []
    figures = {
        line.split()[0]: float(line.split()[1])
        for line in exposed.splitlines()
        if line.startswith("cachet_tokenizer_")
    }
    assert figures["cachet_tokenizer_image_cache_hits_total"] == 1
    assert figures["cachet_tokenizer_image_cache_misses_total"] == 3
    assert figures["cachet_tokenizer_image_cache_evictions_total"] == 2
    assert figures["cachet_tokenizer_image_cache_bytes"] == 112 * 56 * 3 + 32
    assert figures["cachet_tokenizer_image_cache_capacity_bytes"] == 20_000


def _bad_cases(image_server: ImageServer) -> list[tuple[list[common_pb2.ChatMessage], str, str, str]]:
    """(messages, model, the part named, a word of the message)."""
    huge = np.zeros((2100, 2100, 3), dtype=np.uint8)  # 4.4M pixels, a tiny PNG
    truncated = png(_random_image(40, 60))[:-40]
    whole = png(_random_image(40, 60))
    scrambled = whole[:100] + bytes(255 - b for b in whole[100:-100]) + whole[-100:]
    image_server.routes["/moved"] = (302, {"Location": "http://127.0.0.1/elsewhere.png"}, b"")
    image_server.routes["/missing"] = (404, {}, b"")
    image_server.routes["/big"] = (200, {}, b"\0" * 300_000)
    part = "messages[1].content[1].image_url"
    ok = image(SMALL)

    def conversation(bad: common_pb2.ContentPart) -> list[common_pb2.ChatMessage]:
        return [common_pb2.ChatMessage(role="system", content=[text("hi")]), user(text("see"), bad)]

    return [
        (conversation(image("data:image/png;base64,@@@not base64@@@")), VISION_MODEL_ID, part, "base64"),
        (conversation(image("data:image/png,plain")), VISION_MODEL_ID, part, "base64"),
        (conversation(image("data:text/plain;base64,aGk=")), VISION_MODEL_ID, part, "not an image"),
        (conversation(image(data_url(b"GIF89a garbage"))), VISION_MODEL_ID, part, "supported format"),
        (conversation(image(data_url(scrambled))), VISION_MODEL_ID, part, "decoded"),
        (conversation(image(data_url(b"not an image at all"))), VISION_MODEL_ID, part, "supported format"),
        (
            conversation(image(data_url(png(_random_image(40, 60), "BMP")))),
            VISION_MODEL_ID,
            part,
            "supported format",
        ),
        (conversation(image(data_url(truncated))), VISION_MODEL_ID, part, "decoded"),
        (conversation(image(data_url(b"\0" * 300_000))), VISION_MODEL_ID, part, "200,000 bytes"),
        (
            conversation(image(data_url(png(Image.fromarray(huge))))),
            VISION_MODEL_ID,
            part,
            "4,000,000 pixels",
        ),
        (conversation(image("ftp://127.0.0.1/a.png")), VISION_MODEL_ID, part, "data:image"),
        (conversation(image("https://images.example.com/a.png")), VISION_MODEL_ID, part, "allow-list"),
        (
            conversation(image(image_server.url("/small.png", host="localhost"))),
            VISION_MODEL_ID,
            part,
            "allow-list",
        ),
        (conversation(image(image_server.url("/moved"))), VISION_MODEL_ID, part, "redirect"),
        (conversation(image(image_server.url("/missing"))), VISION_MODEL_ID, part, "HTTP 404"),
        (conversation(image(image_server.url("/big"))), VISION_MODEL_ID, part, "200,000 bytes"),
        (
            [user(ok, ok, ok, text("and"), image(TALL))],
            VISION_MODEL_ID,
            "messages[0].content[4].image_url",
            "more than 3",
        ),
        (conversation(ok), TEXT_MODEL_ID, part, "vision encoder"),
    ]


async def test_every_bad_image_is_invalid_argument_naming_its_part(
    stub: tokenizer_pb2_grpc.TokenizerServiceStub, image_server: ImageServer
) -> None:
    # Counting only refuses what a request to generate would: a count is what it would be billed.
    for (messages, model, field, word), count_only in itertools.product(
        _bad_cases(image_server), (False, True)
    ):
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.ApplyChatTemplate(request(*messages, model=model, count_only=count_only))
        error = raised.value
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, word, count_only, error.details())
        assert error.details().startswith(f"{field}: ") and word in error.details(), error.details()
        assert error_info_from_metadata(error.trailing_metadata()).param == field


async def test_a_host_off_the_allow_list_is_never_contacted(
    stub: tokenizer_pb2_grpc.TokenizerServiceStub, image_server: ImageServer
) -> None:
    image_server.routes["/never.png"] = (200, {}, png(_random_image(40, 60)))
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        # The same local server, named by a host the allow-list does not hold.
        await stub.ApplyChatTemplate(request(user(image(image_server.url("/never.png", host="localhost")))))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "/never.png" not in image_server.requests


def test_a_fetch_has_one_deadline_however_quick_each_read(image_server: ImageServer) -> None:
    image_server.routes["/drip"] = (200, {"X-Drip": "1"}, b"x" * 40)
    limits = ImageLimits(url_hosts=frozenset({"127.0.0.1"}), fetch_timeout_seconds=0.5)
    started = time.monotonic()
    with pytest.raises(InvalidArgument) as raised:
        image_bytes(image_server.url("/drip"), "part", limits)
    assert "took over 0.5 s" in raised.value.message and time.monotonic() - started < 1.5


def test_transparency_is_white_and_exif_orientation_is_applied() -> None:
    rgba = Image.new("RGBA", (4, 2), (10, 20, 30, 255))
    rgba.putpixel((0, 0), (0, 0, 0, 0))
    decoded = decode_rgb(png(rgba), "part", ImageLimits())
    assert decoded.mode == "RGB" and decoded.getpixel((0, 0)) == (255, 255, 255)
    assert decoded.getpixel((1, 0)) == (10, 20, 30)
    wide = Image.new("RGB", (40, 20), (200, 0, 0))
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 degrees clockwise to view
    out = io.BytesIO()
    wide.save(out, format="JPEG", exif=exif.tobytes())
    assert decode_rgb(out.getvalue(), "part", ImageLimits()).size == (20, 40)


async def test_text_that_spells_the_placeholder_is_refused(
    stub: tokenizer_pb2_grpc.TokenizerServiceStub,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await stub.ApplyChatTemplate(request(user(text("sneaky <|media_pad|>"), image(SMALL))))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "2 image placeholders" in raised.value.details()


def test_a_model_without_a_vision_config_has_no_vision(
    text_model: TokenizerModel, vision_model: TokenizerModel
) -> None:
    assert text_model.info.vision is None
    vision = vision_model.info.vision
    assert vision is not None and vision.placeholder_text == MARKUP
    assert (vision.patch_size, vision.merge_kernel, vision.max_patches, vision.max_patches_per_side) == (
        14,
        (2, 2),
        16384,
        512,
    )


def test_vision_info_reads_the_budget_and_either_placeholder_key() -> None:
    specials = (SpecialToken("<|media_pad|>", 7), SpecialToken("<|media_begin|>", 8))
    config = {"vision_config": {"patch_size": 16, "merge_kernel_size": 2}, "image_token_id": 7}
    # transformers' processor keys, then Moonshot's media_proc_cfg.
    hf = vision_info(config, {"max_patches": 100, "size": {"max_height": 20}}, specials)
    moonshot = vision_info(
        config, {"media_proc_cfg": {"in_patch_limit": 50, "patch_limit_on_one_side": 9}}, specials
    )
    assert hf is not None and moonshot is not None
    assert (hf.patch_size, hf.merge_kernel, hf.max_patches, hf.max_patches_per_side) == (16, (2, 2), 100, 20)
    assert (moonshot.max_patches, moonshot.max_patches_per_side) == (50, 9)
    # Without <|media_content|> and <|media_end|> in the vocabulary: the placeholder alone.
    assert hf.placeholder_token_id == 7 and hf.placeholder_text == "<|media_pad|>"
    assert vision_info({"model_type": "kimi_k2"}, {}, specials) is None
    with pytest.raises(ValueError, match="media_placeholder_token_id"):
        vision_info({"vision_config": {}}, {}, specials)
    with pytest.raises(ValueError, match="not a special token"):
        vision_info({"vision_config": {}, "media_placeholder_token_id": 99}, {}, specials)


async def test_the_tiny_kimi_k25_checkpoint_takes_images(tmp_path_factory: pytest.TempPathFactory) -> None:
    path = write_tiny_model(tmp_path_factory.mktemp("kimi-k25") / "m", family="kimi-k2.5")
    model = TokenizerModel.load("tiny-kimi-k2.5", path)
    assert model.info.vision is not None
    markup = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
    assert model.info.vision.placeholder_text == markup
    servicer = TokenizerServicer(ModelRegistry([model]), max_input_chars=10_000, image_limits=LIMITS)
    running = await create_server(TokenizerSettings(port=0, models=[]), [servicer.register], [SERVICE_NAME])
    try:
        async with create_channel(running.address) as channel:
            reply = await tokenizer_pb2_grpc.TokenizerServiceStub(channel).ApplyChatTemplate(
                request(user(text("what is this?"), image(TALL)), model="tiny-kimi-k2.5")
            )
    finally:
        await running.stop(grace=None)
    assert markup in reply.prompt
    (only,) = reply.images
    pad = model.info.vision.placeholder_token_id
    assert list(reply.token_ids).count(pad) == only.num_tokens == 8
    assert list(reply.token_ids[only.token_offset : only.token_offset + 8]) == [pad] * 8
