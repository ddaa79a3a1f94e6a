"""The nineteen ICML 2025 papers of the lab, and the tour: one registry for the index and tools.

Each entry's ``stem`` is the notebook's file stem (``notebooks/<stem>.ipynb``) and the name of its
run record (``reports/<stem>.json``). Titles, authors and arXiv ids are the papers' own (arXiv
abstract pages); ``*`` marks equal contribution, as in the papers. ``bench`` names the module whose
``@lab.core.bench.register`` entry `python -m lab bench` runs (empty: the paper has no bench). ``LIMITS``: the
ranges of each notebook's own numeric knobs, which the runner checks before any kernel starts.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Paper:
    number: int  # 0 for the tour
    slug: str  # notebook stem without its number: `gather_aggregate`
    short: str  # the name used in tables: `G&A`
    title: str
    authors: str = ""
    arxiv: str | None = None
    bench: str = ""  # the module that registers the paper's `python -m lab bench` entry (lab.core.bench), if any

    @property
    def stem(self) -> str:
        """`09_gather_aggregate`: notebook stem and run-record name."""
        return f"{self.number:02d}_{self.slug}"

    @property
    def is_paper(self) -> bool:
        return self.number > 0


TOUR = Paper(0, "tour", "Tour", "Tour of the lab (no paper): in-context recall in a tiny transformer")

PAPERS: tuple[Paper, ...] = (
    Paper(1, "expo", "EXPO", "Explicit Preference Optimization: No Need for an Implicit Reward Model",
          "Xiangkun Hu, Lemin Kong, Tong He, David Wipf", "2506.07492"),
    Paper(2, "popper", "POPPER", "Automated Hypothesis Validation with Agentic Sequential Falsifications",
          "Kexin Huang*, Ying Jin*, Ryan Li*, Michael Y. Li, Emmanuel Candès, Jure Leskovec", "2502.09858"),
    Paper(3, "tlm", "TLM", "Test-Time Learning for Large Language Models",
          "Jinwu Hu, Zitian Zhang, Guohao Chen, Xutao Wen, Chao Shuai, Wei Luo, Bin Xiao, Yuanqing Li, "
          "Mingkui Tan", "2505.20633"),
    Paper(4, "emi", "EMI",
          "Understanding Multimodal LLMs Under Distribution Shifts: An Information-Theoretic Approach",
          "Changdae Oh, Zhen Fang, Shawn Im, Xuefeng Du, Yixuan Li", "2502.00577"),
    Paper(5, "floe", "FloE", "FloE: On-the-Fly MoE Inference on Memory-constrained GPU",
          "Yuxin Zhou*, Zheng Li*, Jun Zhang, Jue Wang, Yiping Wang, Zhongle Xie, Ke Chen, Lidan Shou",
          "2505.05950", bench="lab.moe.floe_bench"),
    Paper(6, "hc_smoe", "HC-SMoE", "Retraining-Free Merging of Sparse MoE via Hierarchical Clustering",
          "I-Chun Chen, Hsu-Shen Liu, Wei-Fang Sun, Chen-Hao Chao, Yen-Chang Hsu, Chun-Yi Lee", "2410.08589"),
    Paper(7, "olica", "Olica", "Olica: Efficient Structured Pruning of Large Language Models without Retraining",
          "Jiujun He, Huazhen Lin", "2506.08436"),
    Paper(8, "latent_tokens", "Token Assorted",
          "Token Assorted: Mixing Latent and Text Tokens for Improved Language Model Reasoning",
          "DiJia Su, Hanlin Zhu, Yingchen Xu, Jiantao Jiao, Yuandong Tian, Qinqing Zheng", "2502.03275"),
    Paper(9, "gather_aggregate", "Gather & Aggregate",
          "Understanding the Skill Gap in Recurrent Language Models: The Role of the Gather-and-Aggregate "
          "Mechanism", "Aviv Bick, Eric P. Xing, Albert Gu", "2504.18574"),
    Paper(10, "magellan", "MAGELLAN",
          "MAGELLAN: Metacognitive predictions of learning progress guide autotelic LLM agents in large goal "
          "spaces", "Loris Gaven, Thomas Carta, Clément Romac, Cédric Colas, Sylvain Lamprier, Olivier Sigaud, "
          "Pierre-Yves Oudeyer", "2502.07709"),
    Paper(11, "hps", "HPS", "HPS: Hard Preference Sampling for Human Preference Alignment",
          "Xiandong Zou, Wanyu Lin, Yuchen Li, Pan Zhou", "2502.14400"),
    Paper(12, "infalign", "InfAlign", "InfAlign: Inference-aware language model alignment",
          "Ananth Balashankar*, Ziteng Sun*, Jonathan Berant, Jacob Eisenstein, Michael Collins, Adrian Hutter, "
          "Jong Lee, Chirag Nagpal, Flavien Prost, Aradhana Sinha, Ananda Theertha Suresh, Ahmad Beirami",
          "2412.19792"),
    Paper(13, "rip", "RIP", "R.I.P.: Better Models by Survival of the Fittest Prompts",
          "Ping Yu, Weizhe Yuan, Olga Golovneva, Tianhao Wu, Sainbayar Sukhbaatar, Jason Weston, Jing Xu",
          "2501.18578"),
    Paper(14, "roste", "RoSTE",
          "RoSTE: An Efficient Quantization-Aware Supervised Fine-Tuning Approach for Large Language Models",
          "Quan Wei, Chung-Yiu Yau, Hoi-To Wai, Yang (Katie) Zhao, Dongyeop Kang, Youngsuk Park, Mingyi Hong",
          "2502.09003"),
    Paper(15, "neutral_residues", "Neutral residues", "Neutral Residues: Revisiting Adapters for Model Extension",
          "Franck Signe Talla, Édouard Grave, Hervé Jégou", "2410.02744"),
    Paper(16, "banditspec", "BanditSpec", "BanditSpec: Adaptive Speculative Decoding via Bandit Algorithms",
          "Yunlong Hou, Fengzhuo Zhang, Cunxiao Du, Xuan Zhang, Jiachun Pan, Tianyu Pang, Chao Du, "
          "Vincent Y. F. Tan, Zhuoran Yang", "2505.15141", bench="lab.reasoning.banditspec_bench"),
    Paper(17, "over_tokenized", "Over-tokenized",
          "Over-Tokenized Transformer: Vocabulary is Generally Worth Scaling",
          "Hongzhi Huang, Defa Zhu, Banggu Wu, Yutao Zeng, Ya Wang, Qiyang Min, Xun Zhou", "2501.16975"),
    Paper(18, "sgu_sql", "SGU-SQL", "Structure-Guided Large Language Models for Text-to-SQL Generation",
          "Qinggang Zhang, Hao Chen, Junnan Dong, Shengyuan Chen, Feiran Huang, Xiao Huang", "2402.13284"),
    Paper(19, "cdpo", "cDPO",
          "Critical Tokens Matter: Token-Level Contrastive Estimation Enhances LLM's Reasoning Capability",
          "Zicheng Lin, Tian Liang, Jiahao Xu, Qiuzhi Liu, Xing Wang, Ruilin Luo, Chufan Shi, Siheng Li, "
          "Yujiu Yang, Zhaopeng Tu", "2411.19943"),
)

ALL: tuple[Paper, ...] = (TOUR, *PAPERS)  # the index's rows, in order
BY_STEM: dict[str, Paper] = {p.stem: p for p in ALL}

# The values each notebook's own knobs may take (the contract parameters are `lab.core.params.validate`'s): comparisons
# of parameter names and numbers (`lab.core.params.check_limits`), the runner refuses an override outside them with
# one sentence before any kernel starts. Each excludes what crashes or cannot mean anything (a probability outside
# [0, 1], a learning rate ≤ 0, nothing left to train on), no more; "0: the scale's" knobs keep 0. Limits that depend
# on the data or the model (rows in a file, experts in a checkpoint) are checked inside the notebook. `FREE`: knobs
# that take any number (named, so that tests/test_hygiene.py knows every numeric knob was considered).
_CKPT = ("lr > 0", "max_len >= 0")  # the preference-tuning checkpoint arms (LoRA, AdamW; max_len 0: the scale's)
_BLOCKS = ("n_blocks >= 1", "block_len >= 2")  # lab.data.text blocks: a 1-token block has no next-token target
LIMITS: dict[str, tuple[str, ...]] = {
    "01_expo": ("1 <= held_out < n_pairs", "steps >= 0", "lora_r >= 1", "beta > 0", "lam >= 0", *_CKPT),
    "02_popper": ("0 < alpha < 1", "budget >= 1", "llm_hypotheses >= 1"),
    "03_tlm": ("0 < select_frac <= 1", "lr > 0", "n_inputs >= 0", "held_out >= 0", "adapt_lr > 0",
               "tent_tokens >= 0", "max_len >= 0"),
    "04_emi": ("n_queries >= 0", "max_new_tokens >= 0", "club_steps >= 0"),
    "05_floe": ("0 < k < 1", "pcie_gbps > 0", *_BLOCKS),
    "06_hc_smoe": ("r >= 1", *_BLOCKS),  # r < the model's experts per layer: checked by hc_smoe.cluster
    # Olica's sr_allocation: the V/O sparsity 2s/(1+k) and, above s = 0.4, the Q/K sparsity 2ks/(1+k) stay below 1
    # (whether a head keeps a neuron at the model's head dim: olica.make_plan)
    "07_olica": ("0 < s < 1", "k >= 0", "2 * s < 1 + k", "s <= 0.4 or 2 * k * s < 1 + k", "mlp_num >= 0",
                 "0 < lc_ratio <= 1"),
    "08_latent_tokens": ("n_problems >= 1", "ft_steps >= 1", "chunk >= 1", "codebook >= 2"),
    # Little-Zoo: 5 goals leave every family one; above 620,816 the held-out grow-plant family runs out of distinct
    # goals; learning-progress snapshots are taken every 8 rounds (0 rounds: the scale's)
    "10_magellan": ("5 <= n_goals <= 620816", "rounds >= 0", "rounds <= 0 or rounds >= 8", "0 <= transfer <= 1"),
    "11_hps": ("1 <= held_out < n_rows", "steps >= 0", "lora_r >= 1", "beta > 0", "0 <= label_smoothing < 0.5",
               *_CKPT[1:]),
    "12_infalign": ("n_prompts >= 1", "K >= 1", "M >= 2", "max_new_tokens >= 1"),
    "13_rip": ("0 < bad_frac < 1", "0 <= q < 1", "1 <= held_out", "held_out + 3 <= n_prompts", "n_samples >= 2",
               "epochs > 0", *_CKPT),
    "14_roste": ("steps >= 1", "lr > 0", *_BLOCKS),
    "15_neutral_residues": ("steps >= 1", "lr > 0", "alpha >= 0", "n_blocks >= 2", "block_len >= 2"),
    "16_banditspec": ("0 < delta <= 1", "cr_scale_b >= 0", "n_prompts >= 1", "prompt_len >= 1", "gen_len >= 1",
                      "eagle_steps >= 0"),
    "17_over_tokenized": ("n >= 2", "k >= 1", "steps >= 1", "lr > 0", *_BLOCKS),
    "19_cdpo": ("beta_ce >= 0", "gamma >= 0", "0 <= held_out < n_problems", "n_samples >= 0",
                "n_samples <= 0 or n_samples >= 2", "max_new_tokens >= 0", *_CKPT),
}
FREE: dict[str, tuple[str, ...]] = {
    "03_tlm": ("log_p0",),  # SEL's threshold in nats; ≤ 0 takes it from select_frac
    "11_hps": ("gamma",),  # HPS hardness: any finite γ (its curriculum uses γ < 0)
    "17_over_tokenized": ("m",),  # table rows; ≤ 0 picks the first prime from 2V coprime with V
}
