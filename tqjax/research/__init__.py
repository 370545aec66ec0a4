"""Research-only analyses, kept apart from the product path (nothing in tqjax imports them
except research scripts and their tests): `first_order` splits a quantization's NLL change
into its first-order part g·Δ and the rest."""
