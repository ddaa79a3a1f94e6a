"""The nineteen ICML 2025 papers of the lab, and the tour: one registry for the index and tools.

Each entry's ``stem`` is the notebook's file stem (``notebooks/<stem>.ipynb``) and the name of its
run record (``reports/<stem>.json``). Titles, authors and arXiv ids are the papers' own (arXiv
abstract pages); ``*`` marks equal contribution, as in the papers. ``bench`` names the module whose
``@lab.core.bench.register`` entry `python -m lab bench` runs (empty: the paper has no bench).
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
