"""--resume refuses a checkpoint of other rows at the front door. (That a stop and --resume continue the step
count and the loss curve bit for bit is tests/test_reliability.py's: a clean stop, a SIGKILL, a crash mid-save.)"""
from __future__ import annotations

import json

from mmpipe.cli import main
from mmpipe.run_args import TrainArgs
from mmpipe.run_config import resolve
from mmpipe.runtime import checkpoint


def test_resume_refuses_another_row_layout_before_launch(tmp_path, capsys):
    """A checkpoint's data position counts samples of its rows: --resume with another --pack, --max-images,
    --loss-norm or --text-len is one line at the front door naming each change and its saved value (from a
    saved run's mmpipe_state.json; nothing is launched)."""
    out = tmp_path / "run"
    ckpt = out / "checkpoints"
    (ckpt / "global_step3").mkdir(parents=True)
    (ckpt / "latest").write_text("global_step3")
    saved = resolve(TrainArgs(output_dir=str(out), resume=True, preset="tiny"), 2)
    (ckpt / "global_step3" / checkpoint.STATE_FILE).write_text(json.dumps({"rows": checkpoint.row_layout(saved)}))
    checkpoint.check_same_rows(ckpt, saved)  # the same rows: resumable
    base = ["train", "--preset", "tiny", "--output-dir", str(out), "--resume", "--stages", "2", "--steps", "4"]
    for flags, said in ((["--pack", "--max-images", "2"], "--pack on (saved: off), --max-images 2 (saved: 1)"),
                        (["--loss-norm", "sample"], "--loss-norm sample (saved: token)"),
                        (["--text-len", "10"], "--text-len 10 (saved: 12)")):
        assert main(base + flags) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"mmpipe: error: --resume: {said}: "), err
        assert "global_step3 was written with other rows" in err[0]
    # a checkpoint written before the rows were saved is not second-guessed
    (ckpt / "global_step3" / checkpoint.STATE_FILE).write_text(json.dumps({"step": 3}))
    checkpoint.check_same_rows(ckpt, resolve(TrainArgs(output_dir=str(out), resume=True, preset="tiny", pack=True,
                                                       max_images=2), 2))
