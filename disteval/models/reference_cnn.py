"""Small reference networks shipped with disteval (trained by scripts/train_reference_cnns.py)."""
from __future__ import annotations

from torch import nn


class DigitsCNN(nn.Module):
    """CNN for scikit-learn digits. Input float32 [B, 1, 8, 8] in [0, 1]; output logits float32 [B, 10]."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(inplace=True),
                                        nn.Linear(64, num_classes))

    def forward(self, x):
        return self.classifier(self.features(x))


class FashionCNN(nn.Module):
    """CNN for Fashion-MNIST. Input float32 [B, 1, 28, 28] in [0, 1]; output logits float32 [B, 10]."""

    def __init__(self, num_classes: int = 10):
        super().__init__()

        def block(cin, cout):
            return [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
                    nn.MaxPool2d(2)]

        self.features = nn.Sequential(*block(1, 32), *block(32, 64), *block(64, 64))  # 28 -> 14 -> 7 -> 3
        self.classifier = nn.Sequential(nn.Flatten(), nn.Dropout(0.2), nn.Linear(64 * 3 * 3, 128),
                                        nn.ReLU(inplace=True), nn.Linear(128, num_classes))

    def forward(self, x):
        return self.classifier(self.features(x))


def vit_tiny(num_classes: int = 10, image_size: int = 32, patch_size: int = 8, **kwargs) -> nn.Module:
    """A small torchvision VisionTransformer (2 layers, width 32) for offline tests of the ViT path.
    Input float32 [B, 3, image_size, image_size]."""
    from torchvision.models import VisionTransformer

    params = dict(num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64)
    params.update(kwargs)
    return VisionTransformer(image_size=image_size, patch_size=patch_size, num_classes=num_classes, **params)


REFERENCE_MODELS = {"digits_cnn": DigitsCNN, "fashion_cnn": FashionCNN, "vit_tiny": vit_tiny}
SHIPPED_CHECKPOINTS = {"digits_cnn": "digits_cnn.pt", "fashion_cnn": "fashion_cnn.pt"}
