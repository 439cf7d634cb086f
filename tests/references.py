"""What the resume tests share: the run a signalled or restarted one is compared with, and one thread per rank."""

# 4 epochs of batch 32 per rank over 1536 images, on the CPU
RESUME_ARGS = ["--model", "cnn", "--epochs", "4", "--n-train", "1536", "--n-val", "64", "--batch-size", "32",
               "--workers", "0", "--no-progress"]
# bit-identical resumes need the same arithmetic: one thread per rank in every run compared
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
